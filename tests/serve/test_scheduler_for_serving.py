"""What the server relies on from the batch scheduler: a request's events awaited from an
event loop take no thread while they wait (a server streams many requests at once; a thread
per waiting stream would exhaust the loop's executor, six threads on two cores), and closing
with requests still running returns once they finish (SIGTERM's drain)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import attrs
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



def test_a_rows_first_token_streams_before_the_next_decode_step(engine, monkeypatch):
    """Time to first token: a row's first token reaches its handle as the step that drew it
    ends, not after the batch's next forward (pipelined steps read each token a step late),
    whether the row starts alone or joins rows already decoding."""
    from foretell.stream import RequestHandle

    # Prompts whose first token is text by itself (none held back to grow into a character).
    candidates = ("def f(x):", "x = 1", "import os", "class A:", "for i in range(10):")
    first, second = [p for p in candidates if len(first_event(engine, p).tokens) == 1][:2]
    scheduler = Scheduler(engine)
    list(scheduler.submit("x = 1", max_tokens=1))  # the worker is up, token bytes measured
    log, seen = [], set()
    forward, put = engine.model.forward, RequestHandle._put

    def watched(tokens, caches, *args, **kwargs):
        log.append("decode" if tokens.shape[1] == 1 else "prefill")
        return forward(tokens, caches, *args, **kwargs)

    def delivered(handle, item):
        if getattr(item, "type", None) == "text" and handle not in seen:
            seen.add(handle)
            log.append(handle)
        put(handle, item)

    monkeypatch.setattr(engine.model, "forward", watched)
    monkeypatch.setattr(RequestHandle, "_put", delivered)
    try:
        running = scheduler.submit(first, max_tokens=200, ignore_eos=True)
        next(iter(running))
        joining = scheduler.submit(second, max_tokens=4, ignore_eos=True)
        joined_text = joining.text()
        running.cancel()
    finally:
        monkeypatch.setattr(engine.model, "forward", forward)
        scheduler.close(drain=False)
    for handle in (running, joining):
        at = log.index(handle)
        prefilled = max(i for i, entry in enumerate(log[:at]) if entry == "prefill")
        assert log[prefilled + 1 : at] == ["decode"]
    assert joined_text == alone(engine, second, 4)



def test_tokens_drawn_before_a_prefill_chunk_stream_before_it(engine, monkeypatch):
    """A new prompt's prefill holds the worker for as long as its chunk takes: the token a
    pipelined step already drew for each running row is read and streamed first, not after
    the prefill (inter-token latency while requests arrive)."""
    scheduler = Scheduler(engine)
    list(scheduler.submit("x = 1", max_tokens=1))  # the worker is up, token bytes measured
    forward, decodes, at_prefill = engine.model.forward, [0], []

    def watched(tokens, caches, *args, **kwargs):
        if tokens.shape[1] == 1:
            decodes[0] += 1
        elif scheduler._rows:  # a prefill while a row decodes: what has that row committed?
            at_prefill.append((decodes[0], len(scheduler._rows[0].state.generated)))
        return forward(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", watched)
    try:
        running = scheduler.submit("def f(x):", max_tokens=200, ignore_eos=True)
        events = iter(running)
        for _ in range(3):
            next(events)
        joining = scheduler.submit("import os\nimport sys", max_tokens=4, ignore_eos=True)
        joining.text()
        running.cancel()
    finally:
        monkeypatch.setattr(engine.model, "forward", forward)
        scheduler.close(drain=False)
    assert at_prefill, "the second prompt was never prefilled beside the running row"
    for steps, committed in at_prefill:
        assert committed == steps  # every decode step's token, the last one's included


def first_event(engine, prompt):
    return next(e for e in engine.generate(prompt, max_tokens=4, ignore_eos=True,
                                           speculate=False) if e.type == "text")


def test_the_server_submits_on_its_loop_once_submitting_cannot_wait_on_mlx(engine):
    """A hop to an executor thread costs a request two GIL hand-offs, each waiting up to a
    switch interval while the worker runs Python; the server takes one only where
    submitting can block: the scheduler's first request (it measures a token's KV bytes on
    MLX, behind the worker) and a grammar's (it compiles)."""
    from foretell.config import SamplingConfig
    from foretell.serve.generation import Backend, Job

    class Routes:
        start = Backend.start

        def __init__(self, scheduler):
            self.scheduler, self.on = scheduler, []

        def _submit(self, job):
            self.on.append(threading.current_thread())
            return None if job.grammar else Backend._submit(self, job)

    scheduler = Scheduler(engine)
    routes = Routes(scheduler)
    job = Job(ids=engine.tokenizer.encode("x = 1"), max_tokens=3, sampling=SamplingConfig())

    async def start(job, executor=None):
        if executor is not None:
            asyncio.get_running_loop().set_default_executor(executor)
        return await routes.start(job)

    try:
        assert not scheduler.submits_at_once
        first = asyncio.run(start(job))
        assert routes.on[-1] is not threading.main_thread()  # it measured on MLX
        want = alone(engine, "x = 1", 3)
        assert first.text() == want and scheduler.submits_at_once
        second = asyncio.run(start(job, NoThreads(max_workers=1)))
        assert routes.on[-1] is threading.main_thread()
        assert second.text() == want
        asyncio.run(start(attrs.evolve(job, grammar="start: /[a-z]+/")))
        assert routes.on[-1] is not threading.main_thread()
    finally:
        scheduler.close(drain=False)


def test_a_request_waiting_for_a_row_reports_its_wait_apart_from_its_ttft(engine):
    """``Stats.queued_s``: submitted to admitted. With one row, the second request waits
    out the whole of the first."""
    scheduler = Scheduler(engine, max_rows=1)
    try:
        first = scheduler.submit("def f(x):", max_tokens=16, ignore_eos=True)
        second = scheduler.submit("x = 1", max_tokens=2, ignore_eos=True)
        a = [e for e in first if e.type == "stats"][0]
        b = [e for e in second if e.type == "stats"][0]
    finally:
        scheduler.close()
    ran = a.ttft_s + (a.generated_tokens - 1) / a.generation_tps  # admitted to finished
    assert b.queued_s >= 0.9 * ran > 0
    assert a.queued_s < b.queued_s and b.ttft_s < b.queued_s
