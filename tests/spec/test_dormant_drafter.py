"""A row's drafter is fed when the row first drafts, not as it joins: rows of a batch that
decodes plainly never pay for their drafter's prefill, and a request's first token comes by a
plain step, before its drafter is fed. Output stays what each request streams alone; where
the cache tier stores the drafter's state with the prompt and drafting is on (an MTP head's:
always), the drafter is fed at once (tests/spec/test_draft_state_cache.py)."""

from __future__ import annotations

import pytest
from test_batch_step_timing import ScriptedWidths

PROMPTS = [[11, 57, 300, 4, 89, 23, 8], [120, 7, 250, 3, 9]]


@pytest.fixture
def fed(monkeypatch):
    """The sequences the two-model drafter's rows are fed, one list per append."""
    from foretell_two_model.rows import TwoModelRows

    appends, append = [], TwoModelRows.append
    monkeypatch.setattr(TwoModelRows, "append", lambda rows, starts: (
        appends.append([list(s.feed.tokens) for s in starts]), append(rows, starts))[1])
    return appends


def _two_model(engines, model_dirs, registry, name="qwen3-other"):
    from foretell.plugin import Kind
    from foretell.spec import make_speculator

    config = registry.get(Kind.DRAFT, "two-model").config
    return make_speculator(registry, engines["qwen3"].target, "two-model",
                           config(model=str(model_dirs[name])), max_tokens=3)


def _plain(engine, prompt, n):
    return engine.generate_text(prompt, max_tokens=n, ignore_eos=True, speculate=False)


def _texts(handles):
    return ["".join(e.text for e in list(h)[:-1]) for h in handles]


def test_rows_of_a_batch_that_never_drafts_never_feed_their_drafter(engines, model_dirs,
                                                                   registry, fed):
    from foretell.scheduler import Scheduler

    engine = engines["qwen3"]
    speculator = _two_model(engines, model_dirs, registry)
    scheduler = Scheduler(engine)
    scheduler._policy = ScriptedWidths([])  # plain decoding at every step
    handles = [scheduler.submit(p, max_tokens=12, ignore_eos=True, speculate=speculator)
               for p in PROMPTS]
    texts = _texts(handles)
    scheduler.close()
    assert fed == []
    assert texts == [_plain(engine, p, 12) for p in PROMPTS]


def test_a_batch_that_starts_drafting_feeds_its_rows_then_in_one_append(engines, model_dirs,
                                                                       registry, fed):
    from foretell.scheduler import Scheduler

    engine = engines["qwen3"]
    speculator = _two_model(engines, model_dirs, registry)
    scheduler = Scheduler(engine)
    scheduler._policy = ScriptedWidths([0, 0, 0, 2, 2, 2])
    handles = [scheduler.submit(p, max_tokens=16, ignore_eos=True, speculate=speculator)
               for p in PROMPTS]
    texts = _texts(handles)
    scheduler.close()
    # Fed once, together, at the first drafted step: each its prompt and what it generated.
    assert len(fed) == 1 and len(fed[0]) == 2
    for sequence, prompt in zip(fed[0], PROMPTS):
        assert sequence[: len(prompt)] == prompt and len(sequence) > len(prompt)
    assert texts == [_plain(engine, p, 16) for p in PROMPTS]


def test_a_lone_requests_first_token_comes_before_its_drafter_is_fed(engines, model_dirs,
                                                                    registry, fed):
    """Its first step is plain whatever its length policy would say; the drafter hears the
    prompt and what came since at the first round that drafts."""
    engine = engines["qwen3"]
    speculator = _two_model(engines, model_dirs, registry, name="qwen3")
    events = list(engine.generate(PROMPTS[0], max_tokens=10, ignore_eos=True,
                                  speculate=speculator))
    text = "".join(e.text for e in events[:-1])
    (sequence,), = fed
    assert sequence[: len(PROMPTS[0])] == PROMPTS[0] and len(sequence) > len(PROMPTS[0])
    assert events[-1].speculation["drafted"] > 0
    assert text == _plain(engine, PROMPTS[0], 10)


def test_a_look_that_feeds_rows_tells_the_policy_what_feeding_them_added(engines, model_dirs,
                                                                         registry):
    from foretell.scheduler import Scheduler

    class Told(ScriptedWidths):
        def __init__(self, script):
            super().__init__(script)
            self.fed = []

        def woke(self, fed, rows, width, seconds):
            self.fed.append(fed)

    speculator = _two_model(engines, model_dirs, registry)
    scheduler = Scheduler(engines["qwen3"])
    scheduler._policy = policy = Told([0, 0, 0, 2, 2, 0, 2])
    handles = [scheduler.submit(p, max_tokens=16, ignore_eos=True, speculate=speculator)
               for p in PROMPTS]
    _texts(handles)
    scheduler.close()
    assert policy.fed == [2]  # once, for both rows; fed rows cost nothing more


def test_a_row_joining_where_nothing_drafts_stores_its_prompt_without_drafter_state(
        engines, model_dirs, registry, monkeypatch):
    """Its drafter was not fed by the time the prompt's entry was stored: a later request
    with that prompt, joining where drafting is on, prefills its drafter."""
    from foretell.cache.tier import CacheTier
    from foretell.scheduler import Scheduler

    engine = engines["qwen3"]
    monkeypatch.setattr(engine, "cache", CacheTier.for_engine(engine))
    speculator = _two_model(engines, model_dirs, registry, name="qwen3")
    prompt = [(11 * i) % 400 + 3 for i in range(24)]
    scheduler = Scheduler(engine)
    results = []
    for drafting in (False, True):
        scheduler._alone_drafting = drafting  # what the last lone row chose
        events = list(scheduler.submit(prompt, max_tokens=10, ignore_eos=True,
                                       speculate=speculator))
        results.append(("".join(e.text for e in events[:-1]), events[-1]))
    scheduler.close()
    (first, _), (again, stats) = results
    assert stats.cached_from == "ram" and stats.speculation["draft_cached_tokens"] == 0
    assert first == again == _plain(engine, prompt, 10)


def test_mtp_rows_hear_their_prompts_states_when_they_first_draft(monkeypatch):
    """A drafter reading hidden states waits too: rows of a batch that never drafts never
    feed the MTP head; rows that draft later hear their prompt with its states (kept from
    the prefill), then the tokens since with theirs, and stream plain greedy's text."""
    import mlx.core as mx

    import foretell
    from foretell.scheduler import Scheduler
    from foretell_qwen.mtp_rows import MTPRows

    demo = foretell.load("demo")
    speculator = demo.use_draft("mtp", max_tokens=3)
    prompts = [demo.encode_prompt(t, chat=False) for t in
               ("def fibonacci(n):\n    if n < 2:", "import os\n\n\ndef list_files(path):")]
    starts, feeds = [], []
    append, draft = MTPRows.append, MTPRows.draft
    monkeypatch.setattr(MTPRows, "append", lambda rows, s: (
        starts.append(list(s)), append(rows, s))[1])
    monkeypatch.setattr(MTPRows, "draft", lambda rows, f, lengths: (
        feeds.append(list(f)), draft(rows, f, lengths))[1])
    for script in ([], [0, 0, 0, 2, 2, 2]):
        starts.clear()
        feeds.clear()
        scheduler = Scheduler(demo)
        scheduler._policy = ScriptedWidths(script)
        handles = [scheduler.submit(p, max_tokens=14, ignore_eos=True, speculate=speculator)
                   for p in prompts]
        texts = _texts(handles)
        scheduler.close()
        assert texts == [_plain(demo, p, 14) for p in prompts]
        if not script:
            assert starts == []
            continue
        (joined,) = starts  # one append, at the first drafted step
        for start, prompt in zip(joined, prompts):
            hidden, _ = demo.model.forward(mx.array([prompt[:-1]]), demo.model.make_caches())
            assert list(start.feed.tokens) == prompt
            assert mx.allclose(start.feed.hidden, hidden, atol=1e-3, rtol=1e-3).item()
        assert all(len(f.tokens) == f.hidden.shape[1] > 0 for f in feeds[0])  # what came since


def test_mtp_rows_whose_prompts_are_cached_feed_the_head_as_they_join(monkeypatch):
    """Where the prompt's entry is stored, an MTP row's head is fed at join even in a batch
    that never drafts: its state goes with the entry, so a later hit can speculate (one
    without it could not: the prefix's hidden states are never computed then)."""
    import foretell
    from foretell.cache.tier import CacheTier
    from foretell.scheduler import Scheduler
    from foretell_qwen.mtp_rows import MTPRows

    demo = foretell.load("demo")
    monkeypatch.setattr(demo, "cache", CacheTier.for_engine(demo))
    speculator = demo.use_draft("mtp", max_tokens=3)
    prompts = [demo.encode_prompt(t, chat=False) for t in ("def area(r):", "x = [i * i for")]
    starts = []
    append = MTPRows.append
    monkeypatch.setattr(MTPRows, "append", lambda rows, s: (
        starts.append(list(s)), append(rows, s))[1])
    class Plain(ScriptedWidths):
        drafting = False  # plain decoding at every step, as it was when the rows joined

    scheduler = Scheduler(demo)
    scheduler._policy = Plain([])
    handles = [scheduler.submit(p, max_tokens=6, ignore_eos=True, speculate=speculator)
               for p in prompts]
    texts = _texts(handles)
    scheduler.close()
    assert sum(len(s) for s in starts) == len(prompts)
    assert texts == [_plain(demo, p, 6) for p in prompts]
