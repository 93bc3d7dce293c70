"""An engine used from several threads: requests run together on the scheduler's worker,
each giving what it gives alone, none held up by another left unread; a generation may be
iterated on another thread than its caller's, and closing it cancels its request; and the
process exits cleanly after (MLX streams are per thread, docs/generation.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

PROMPTS = [[3 + i, 40 + 2 * i, 17, 90 + i, 5] for i in range(6)]


def tokens(events) -> list[int]:
    return [t for e in events if e.type == "text" for t in e.tokens]


def alone(engine, prompt, n=12) -> list[int]:
    return tokens(engine.generate(prompt, max_tokens=n, ignore_eos=True))


def test_a_generation_started_on_one_thread_continues_on_another(engine):
    expected = alone(engine, PROMPTS[0])
    stream = engine.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
    first = next(stream)
    rest: list = []
    failed: list = []

    def finish() -> None:
        try:
            rest.extend(stream)
        except Exception as exc:  # reported below, not lost in the thread
            failed.append(exc)

    worker = threading.Thread(target=finish)
    worker.start()
    worker.join()
    assert failed == []
    assert tokens([first, *rest]) == expected


def test_a_generation_left_open_holds_up_no_other(engine):
    """Every request runs on the scheduler's worker: one whose reader stopped reading (on
    this thread or another) does not keep the next from running, and each gives what it
    gives alone."""
    stream = engine.generate(PROMPTS[0], max_tokens=6, ignore_eos=True)
    first = next(stream)
    other: dict[str, list[int]] = {}
    thread = threading.Thread(target=lambda: other.update(B=alone(engine, PROMPTS[1], 6)))
    thread.start()
    thread.join()  # B ran to its end while A waited to be read
    assert other == {"B": alone(engine, PROMPTS[1], 6)}
    assert alone(engine, PROMPTS[2], 6) == alone(engine, PROMPTS[2], 12)[:6]  # this thread too
    assert tokens([first, *stream]) == alone(engine, PROMPTS[0], 6)


def test_closing_a_generation_midway_cancels_its_request(engine):
    stream = engine.generate(PROMPTS[0], max_tokens=5000, ignore_eos=True)
    next(stream)
    stream.close()
    assert stream.handle.cancelled
    # The worker drops cancelled rows before it admits the next request.
    assert alone(engine, PROMPTS[1], 2) == alone(engine, PROMPTS[1], 12)[:2]
    assert engine.scheduler.running == 0 and engine.scheduler.queue_depth == 0
    # What was streamed before the cancel (perhaps nothing more: a first token streams as
    # soon as it is drawn), then the end: no stats, no error.
    events = list(stream.handle)
    assert all(e.type == "text" for e in events)


def test_an_idle_worker_ends_and_the_next_request_starts_another(engine, monkeypatch):
    """An engine nobody uses holds no thread (and no thread holds the engine)."""
    from foretell import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "IDLE_EXIT_S", 0.05)
    expected = alone(engine, PROMPTS[3], 4)
    worker = engine.scheduler._thread
    assert worker is not None
    worker.join(timeout=60)
    assert not worker.is_alive() and engine.scheduler._thread is None
    assert alone(engine, PROMPTS[3], 4) == expected
    assert engine.scheduler._thread is not worker


SCRIPT = """
import json, sys, threading
import foretell

engine = foretell.load(sys.argv[1])
prompts = {prompts}

def run(prompt):
    events = engine.generate(prompt, max_tokens=16, ignore_eos=True)
    return [t for e in events if e.type == "text" for t in e.tokens]

alone = [run(p) for p in prompts]
together = {{}}
failures = []
start = threading.Barrier(len(prompts))

def worker(i):
    try:
        start.wait()
        together[i] = run(prompts[i])
    except Exception as exc:
        failures.append(repr(exc))

threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
for t in threads:
    t.start()
for t in threads:
    t.join()
same = [together.get(i) == alone[i] for i in range(len(prompts))]

# One generation handed from this thread to another halfway.
stream = engine.generate(prompts[0], max_tokens=16, ignore_eos=True)
handed = list(next(stream).tokens)
def finish():
    try:
        handed.extend(t for e in stream if e.type == "text" for t in e.tokens)
    except Exception as exc:
        failures.append(repr(exc))

finisher = threading.Thread(target=finish)
finisher.start()
finisher.join()
# One left after its first event: the process exits with its request still decoding.
left = engine.generate(prompts[1], max_tokens=3000, ignore_eos=True)
next(left)
print(json.dumps({{"failures": failures, "same": same, "handed": handed == alone[0]}}))
"""


def test_threads_at_once_get_what_each_gets_alone_and_the_process_exits_cleanly(
        tmp_path):
    from foretell.tools import make_model_dir

    model = make_model_dir(tmp_path / "qwen3", "qwen3")
    script = textwrap.dedent(SCRIPT.format(prompts=PROMPTS))
    done = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True,
                          text=True, timeout=600)
    # A thread's MLX streams outliving it once aborted the process at exit (status 134).
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"failures": [], "same": [True] * len(PROMPTS), "handed": True}
