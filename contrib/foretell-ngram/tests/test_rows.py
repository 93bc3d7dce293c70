"""The n-gram drafter over rows (plugin API 2): a batch of rows drafting through one
NgramRows proposes, row for row, what each row's per-request NgramSource proposes, and rows
speculating in the scheduler stream exactly what each request streams decoded plainly alone."""

from __future__ import annotations

import random

import pytest

from foretell.sampling import Sampler
from foretell.spec import Feed, RowStart
from foretell_ngram import NgramConfig
from foretell_ngram.lookup import NgramIndex, NgramProvider, NgramRows

CONFIG = {"max_ngram": 3, "min_ngram": 1, "tokens_per_match": 2}


def _provider():
    return NgramProvider(NgramConfig(**CONFIG))


def _source(tokens):
    source = _provider().open()
    source.prefill(Feed(list(tokens)))
    return source


def _start(tokens, state=None, state_tokens=()):
    return RowStart(feed=Feed(list(tokens)), sampler=Sampler(None), state=state,
                    state_tokens=list(state_tokens))


def _rows(*sequences):
    rows = _provider().open_rows(None)
    rows.append([_start(s) for s in sequences])
    return rows


def _proposals(draft):
    return [draft.tokens[b, :n].tolist() for b, n in enumerate(draft.lengths)]


def _source_proposal(source, feed, n):
    return source.draft(Feed(list(feed)), n).tokens[0].tolist()


@pytest.mark.parametrize("seed", range(4))
def test_each_row_proposes_what_its_own_source_proposes(seed):
    """Rows of different histories, fed different tokens each round (none some rounds) and
    asked for different lengths (0 included: the row still takes its feed)."""
    rng = random.Random(seed)
    starts = [[rng.randrange(5) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    rows = _rows(*starts)
    sources = [_source(s) for s in starts]
    drafted = 0
    for _ in range(150):
        feeds = [[rng.randrange(5) for _ in range(rng.randint(0, 3))] for _ in starts]
        lengths = [rng.randint(0, 6) for _ in starts]
        draft = rows.draft([Feed(f) for f in feeds], lengths)
        want = [_source_proposal(s, f, n) for s, f, n in zip(sources, feeds, lengths)]
        assert _proposals(draft) == want
        assert all(len(p) <= n for p, n in zip(_proposals(draft), lengths))
        assert draft.q is None  # a lookup chooses deterministically
        drafted += sum(draft.lengths)
        rows.commit([rng.randint(0, n) for n in draft.lengths])
    assert drafted > 0


def test_commit_of_fewer_than_proposed_drafts_from_the_true_sequence():
    """Rejected proposals never enter a row's history: after a commit of fewer tokens than
    proposed, the next round (the kept ones and the target's correction as its feed) drafts
    what a row fed only the true sequence drafts."""
    sequence = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    rows = _rows(sequence, sequence)
    first = _proposals(rows.draft([Feed([]), Feed([])], [4, 4]))
    assert first == [[4, 5, 6, 7], [4, 5, 6, 7]]
    rows.commit([1, 0])
    # Row 0 kept 4 and the target said 9; row 1 kept nothing and the target said 8.
    truths = [sequence + [4, 9], sequence + [8]]
    again = _proposals(rows.draft([Feed([4, 9]), Feed([8])], [4, 4]))
    fresh = _proposals(_rows(*truths).draft([Feed([]), Feed([])], [4, 4]))
    assert again == fresh
    assert again == [_source_proposal(_source(t), [], 4) for t in truths]
    # Had the rejected proposals stayed, the rows would hold other histories than these.
    assert [rows.rows[b].history for b in range(2)] == truths


def test_filter_keeps_the_named_rows_in_their_new_order():
    sequences = [[1, 2, 3, 1, 2], [4, 5, 6, 4, 5], [7, 8, 9, 7, 8]]
    rows = _rows(*sequences)
    rows.filter([2, 0])
    draft = rows.draft([Feed([]), Feed([])], [3, 3])
    assert _proposals(draft) == [[9, 7, 8], [3, 1, 2]]
    rows.filter([1])
    assert _proposals(rows.draft([Feed([3])], [2])) == [[1, 2]]


def test_a_captured_row_is_the_state_its_source_captures_and_restores_without_reindexing(
        monkeypatch):
    rng = random.Random(3)
    history = [rng.randrange(4) for _ in range(30)]
    rows = _rows([9, 9, 9], history)
    state = rows.capture(1)
    expected = _source(history).capture()
    assert state.meta == expected.meta
    assert {k: v.tolist() for k, v in state.tensors.items()} == {
        k: v.tolist() for k, v in expected.tensors.items()}
    assert rows.rows[1].history == history  # capture does not mutate the rows
    # A row joining with the state indexes only the tokens after it, then drafts as a source
    # restored from the same state and fed the same tokens does.
    more = [rng.randrange(4) for _ in range(5)]
    indexed = []
    extend = NgramIndex.extend
    monkeypatch.setattr(NgramIndex, "extend",
                        lambda index, tokens: indexed.append(len(tokens)) or extend(index, tokens))
    restored = _provider().open_rows(None)
    restored.append([_start(history + more, state=state, state_tokens=history)])
    assert indexed == [len(more)]
    source = _provider().open()
    source.restore(state, list(history))
    source.prefill(Feed(more))
    for _ in range(50):
        feed, n = [rng.randrange(4) for _ in range(rng.randint(0, 3))], rng.randint(1, 5)
        assert _proposals(restored.draft([Feed(feed)], [n])) == [
            _source_proposal(source, feed, n)]


def test_a_state_that_does_not_fit_raises_and_leaves_the_rows_as_they_were():
    rows = _rows([1, 2, 1])
    state = _source([5, 6, 5, 6]).capture()
    with pytest.raises(ValueError, match="covers 4 tokens"):
        rows.append([_start([3, 4, 3]), _start([5, 6, 5], state=state, state_tokens=[5, 6, 5])])
    assert [r.history for r in rows.rows] == [[1, 2, 1]]


def test_close_releases_every_row():
    rows = _rows([1, 2], [3, 4])
    rows.close()
    assert rows.draft([], []).tokens.shape == (0, 0)


# --- in the scheduler -------------------------------------------------------------------

PROMPTS = [
    [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42],
    [5],
    [11, 57, 30, 4, 19, 20, 7, 25, 33, 6, 2, 19, 11, 57, 30],
    [7, 3, 40, 12, 12, 9, 7, 3],
]
LENGTHS = [40, 24, 33, 12]


def _speculator(engine, registry, k=4):
    from foretell.spec import make_speculator

    return make_speculator(registry, engine.target, "ngram", NgramConfig(**CONFIG),
                           max_tokens=k, adaptive=False)


def _tokens(events):
    return [t for e in events[:-1] for t in e.tokens]


def test_the_batch_group_serves_ngram_rows_natively(engine, registry):
    from foretell.spec.batch import DraftGroup

    group = DraftGroup(_speculator(engine, registry), engine.target)
    assert isinstance(group.rows, NgramRows)


def test_rows_joining_at_different_times_stream_what_each_request_streams_alone(
        engine, registry, monkeypatch):
    """Greedy rows speculating through one NgramRows, joining while others run and leaving
    at different lengths, each emit plain decoding's tokens, token for token."""
    plain = [_tokens(list(engine.generate(p, max_tokens=n, ignore_eos=True,
                                          speculate=False)))
             for p, n in zip(PROMPTS, LENGTHS)]
    speculator = _speculator(engine, registry)

    def per_request(*_args, **_kwargs):
        raise AssertionError("a batch row drafted through a per-request source")

    monkeypatch.setattr(speculator.provider, "open", per_request)
    from foretell.scheduler import Scheduler

    groups = []  # the drafter's rows, as the scheduler makes them
    made = Scheduler._group
    monkeypatch.setattr(Scheduler, "_group", lambda self, *args: groups.append(
        made(self, *args)) or groups[-1])
    handles, streams, events = [], [], []
    for prompt, n in zip(PROMPTS, LENGTHS):
        if streams:  # the rows before this one are decoding when it joins
            events[-1].extend(next(streams[-1]) for _ in range(3))
        handles.append(engine.submit(prompt, max_tokens=n, ignore_eos=True,
                                     speculate=speculator))
        streams.append(iter(handles[-1]))
        events.append([])
    drafted = accepted = 0
    for want, stream, got in zip(plain, streams, events):
        got.extend(stream)
        assert _tokens(got) == want
        drafted += got[-1].speculation["drafted"]
        accepted += got[-1].speculation["accepted"]
    assert drafted > 0 and accepted > 0
    assert groups and all(isinstance(group.rows, NgramRows) for group in groups)
