"""What the server relies on from the batch scheduler: a request's events awaited from an
event loop take no thread while they wait (a server streams many requests at once; a thread
per waiting stream would exhaust the loop's executor, six threads on two cores), and closing
with requests still running returns once they finish (SIGTERM's drain)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

import foretell
from foretell.scheduler import Scheduler
from foretell.tools import make_model_dir

QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return foretell.load(make_model_dir(tmp_path_factory.mktemp("m"), "qwen3", overrides=QWEN,
                                        seed=0))


def alone(engine, prompt, n):
    return "".join(e.text for e in engine.generate(prompt, max_tokens=n, ignore_eos=True,
                                                   speculate=False) if e.type == "text")


class NoThreads(concurrent.futures.ThreadPoolExecutor):
    def submit(self, *args, **kwargs):
        raise AssertionError("the event loop's executor was asked for a thread")


def test_awaiting_events_uses_no_executor_thread_and_every_stream_completes(engine):
    want = alone(engine, "x = 1", 6)
    scheduler = Scheduler(engine, max_rows=2)

    async def one() -> str:
        handle = scheduler.submit("x = 1", max_tokens=6, ignore_eos=True)
        return "".join([e.text async for e in handle.events() if e.type == "text"])

    async def main() -> list[str]:
        asyncio.get_running_loop().set_default_executor(NoThreads(max_workers=1))
        return await asyncio.gather(*(one() for _ in range(12)))

    try:
        assert asyncio.run(main()) == [want] * 12
    finally:
        scheduler.close(drain=False)


def test_closing_while_requests_run_drains_them_and_returns(engine):
    scheduler = Scheduler(engine)
    handles = [scheduler.submit("def f(x):", max_tokens=24, ignore_eos=True) for _ in range(3)]
    next(iter(handles[0]))  # running, not finished
    closer = threading.Thread(target=scheduler.close)
    closer.start()
    closer.join(timeout=300)
    assert not closer.is_alive(), "close() never returned"
    want = alone(engine, "def f(x):", 24)
    assert [h.text() for h in handles[1:]] == [want, want]


def test_requests_waiting_for_admission_count_against_the_waiting_bound(engine):
    from foretell.scheduler import QueueFull

    scheduler = Scheduler(engine, max_rows=1, max_waiting=2)
    running = scheduler.submit("def f(x):", max_tokens=10_000, ignore_eos=True)
    next(iter(running))  # admitted: the one row is taken
    waiting = [scheduler.submit("x = 1", max_tokens=4, ignore_eos=True) for _ in range(2)]
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        scheduler.submit("x = 1", max_tokens=4, ignore_eos=True)
    running.cancel()
    assert [h.text() for h in waiting] == [alone(engine, "x = 1", 4)] * 2
    scheduler.close()
