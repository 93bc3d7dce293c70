"""Reading many requests from one thread (:func:`foretell.stream.merged`): every event of
every handle, each handle's in its order, as iterating each handle alone gives them; a
request's error is raised to the reader; the handles are left readable no other way."""

from __future__ import annotations

import pytest

from foretell.errors import GenerationError
from foretell.scheduler import Scheduler
from foretell.stream import merged

PROMPTS = ["def fib(n):", "import os\nimport sys\n", "x = 1", "for i in range(10):\n" * 3]


def texts(events):
    return [(e.type, e.text, tuple(e.tokens)) if e.type == "text" else (e.type,)
            for e in events]


def test_merged_yields_every_handles_events_in_order_as_each_alone(engine):
    scheduler = Scheduler(engine)
    lengths = [9, 3, 14, 6]
    alone = [texts(scheduler.submit(p, max_tokens=n, ignore_eos=True))
             for p, n in zip(PROMPTS, lengths)]
    handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True)
               for p, n in zip(PROMPTS, lengths)]
    seen: list[list] = [[] for _ in handles]
    for i, event in merged(handles):
        seen[i].append(event)
    assert [texts(events) for events in seen] == alone
    assert all(events[-1].type == "stats" for events in seen)
    assert all(handle._wakeup is None for handle in handles)
    scheduler.close()


def test_a_failing_request_raises_to_the_merged_reader(engine, monkeypatch):
    scheduler = Scheduler(engine)
    list(scheduler.submit(PROMPTS[2], max_tokens=2, ignore_eos=True))  # the worker is up

    def broken(*args, **kwargs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(engine.model, "forward", broken)
    handles = [scheduler.submit(p, max_tokens=4, ignore_eos=True) for p in PROMPTS[:2]]
    with pytest.raises(GenerationError, match="the device fell over"):
        list(merged(handles))
    monkeypatch.undo()
    scheduler.close()
