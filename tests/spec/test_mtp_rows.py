"""Qwen-MTP over rows (plugin API 2) on the shipped demo target and its MTP head: the head
drafts every row of a batch in one forward per drafted token, each row drafting what the
per-request source drafts alone, and a batch speculating with it streams what each request
decodes plainly alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from foretell.config import SamplingConfig
from foretell.sampling import Sampler
from foretell.scheduler import Scheduler
from foretell.spec import Feed, RowStart, draft_keys

TEXTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "import os\n\n\ndef list_files(path):\n    return [name for name in",
         "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
         "for i in range(10):"]


@pytest.fixture(scope="module")
def demo():
    import foretell

    return foretell.load("demo")


@pytest.fixture(scope="module")
def sequences(demo):
    """Token sequences with the target's hidden states over them (``hidden[:, i]`` is the
    state that predicted token ``i + 1``)."""
    out = []
    for text in TEXTS:
        tokens = demo.encode_prompt(text, chat=False)
        hidden, _ = demo.model.forward(mx.array([tokens], dtype=mx.int32),
                                       demo.model.make_caches())
        mx.eval(hidden)
        out.append((tokens, hidden))
    return out


def _speculator(demo, k=3):
    from foretell.spec import make_speculator

    return make_speculator(demo.registry, demo.target, "mtp", None, max_tokens=k,
                           adaptive=False)


def _provider(demo):
    return _speculator(demo).provider


def _start(sequence, length, sampler=None, **state):
    tokens, hidden = sequence
    sampler = sampler or Sampler()
    return RowStart(feed=Feed(tokens[:length], hidden[:, : length - 1]), sampler=sampler,
                    keys=draft_keys(sampler), **state)


def _feed(sequence, lo, hi):
    """What a row holding ``tokens[:lo]`` hears when its sequence reaches ``tokens[:hi]``."""
    tokens, hidden = sequence
    return Feed(tokens[lo:hi], hidden[:, lo - 1 : hi - 1], hi)


def _rows_of(draft):
    return [draft.tokens[b, :n].tolist() for b, n in enumerate(draft.lengths)]


def _alone(demo, prompt, **options):
    events = list(demo.generate(prompt, speculate=False, **options))
    return [t for e in events[:-1] for t in e.tokens]


def _streamed(handle):
    events = list(handle)
    return [t for e in events[:-1] for t in e.tokens], events[-1]


def test_each_row_drafts_what_the_per_request_source_drafts_alone(demo, sequences):
    """Ragged prompts, ragged feeds and a row fed nothing this round: one batch forward
    pads and trims per row, and every row's drafts are its own source's."""
    provider = _provider(demo)
    prompts, ends = [9, 4, 15, 6], [13, 5, 15, 11]  # row 2 hears nothing new this round
    rows = provider.open_rows(demo.target)
    rows.append([_start(s, p) for s, p in zip(sequences, prompts)])
    feeds = [_feed(s, p, e) for s, p, e in zip(sequences, prompts, ends)]
    got = _rows_of(rows.draft(feeds, [4, 4, 2, 4]))
    for sequence, p, e, n, drafted in zip(sequences, prompts, ends, [4, 4, 2, 4], got):
        source = provider.open(demo.target, Sampler())
        source.prefill(_start(sequence, p).feed)
        assert drafted == source.draft(_feed(sequence, p, e), n).tokens[0].tolist()
        assert len(drafted) == n


def test_a_row_asked_for_no_drafts_still_takes_its_feed(demo, sequences):
    provider = _provider(demo)
    rows = provider.open_rows(demo.target)
    rows.append([_start(s, 6) for s in sequences[:2]])
    first = rows.draft([_feed(s, 6, 9) for s in sequences[:2]], [3, 0])
    assert first.lengths == (3, 0)
    rows.commit([1, 0])
    got = _rows_of(rows.draft([_feed(s, 9, 10) for s in sequences[:2]], [3, 3]))
    source = provider.open(demo.target, Sampler())
    source.prefill(_start(sequences[1], 6).feed)
    source.draft(_feed(sequences[1], 6, 9), 1)
    source.commit(0)
    assert got[1] == source.draft(_feed(sequences[1], 9, 10), 3).tokens[0].tolist()


def test_a_round_runs_the_head_once_per_drafted_token_for_every_row(demo, sequences):
    from foretell.spec.batch import DraftGroup
    from foretell_qwen.mtp_rows import MTPRows

    rows = DraftGroup(_speculator(demo), demo.target).rows
    assert isinstance(rows, MTPRows)  # the native rows, not SourceRows over sources
    rows.append([_start(s, 6) for s in sequences[:3]])
    calls = []
    head = rows.head

    def counted(embedded, hidden, cache):
        calls.append(embedded.shape[0])
        return head(embedded, hidden, cache)

    rows.head = counted
    n = 5
    draft = rows.draft([_feed(s, 6, 6 + k) for s, k in zip(sequences, [1, 3, 2])], [n] * 3)
    assert draft.lengths == (n, n, n)
    assert calls == [3] * n  # one absorbing forward, then n - 1 chained: every row in each


def test_a_row_without_a_state_of_the_target_drafts_nothing_until_it_has_one(demo, sequences):
    """A one-token prompt brings no hidden state: that row drafts nothing, the others draft,
    and once its feed carries states it drafts what its own source drafts."""
    provider = _provider(demo)
    rows = provider.open_rows(demo.target)
    rows.append([_start(sequences[0], 1), _start(sequences[1], 7)])
    first = rows.draft([Feed([], None, 1), Feed([], None, 7)], [3, 3])
    assert first.lengths == (0, 3)
    rows.commit([0, 1])
    second = _rows_of(rows.draft([_feed(sequences[0], 1, 4), _feed(sequences[1], 7, 8)], [3, 3]))
    source = provider.open(demo.target, Sampler())
    source.prefill(_start(sequences[0], 1).feed)
    assert second[0] == source.draft(_feed(sequences[0], 1, 4), 3).tokens[0].tolist()


def test_rolled_back_rounds_leave_each_row_as_a_source_fed_the_same(demo, sequences):
    """Chained positions leave the cache after every round, whatever each row kept."""
    provider = _provider(demo)
    rows = provider.open_rows(demo.target)
    rows.append([_start(s, 5) for s in sequences])
    sources = []
    for s in sequences:
        source = provider.open(demo.target, Sampler())
        source.prefill(_start(s, 5).feed)
        sources.append(source)
    at = [5] * len(sequences)
    for step, accepted in enumerate([[0, 2, 1, 3], [3, 0, 0, 1], [1, 1, 2, 0]]):
        ends = [a + 1 + k for a, k in zip(at, accepted)]
        feeds = [_feed(s, a, e) for s, a, e in zip(sequences, at, ends)]
        got = _rows_of(rows.draft(feeds, [3] * len(sequences)))
        for source, feed, drafted in zip(sources, feeds, got):
            assert drafted == source.draft(feed, 3).tokens[0].tolist(), step
            source.commit(0)
        rows.commit(accepted)
        at = ends


def test_filter_keeps_the_named_rows_in_their_new_order(demo, sequences):
    provider = _provider(demo)
    whole, kept = provider.open_rows(demo.target), provider.open_rows(demo.target)
    for rows in (whole, kept):
        rows.append([_start(s, p) for s, p in zip(sequences, [5, 9, 7, 4])])
    kept.filter([2, 0])
    assert kept.cache.rows == 2 and len(kept.rows) == 2
    # Row 2 hears nothing new: it drafts from what the head held for it before the filter.
    feeds = [_feed(s, p, p + 2) for s, p in zip(sequences, [5, 9, 7, 4])]
    feeds[2] = Feed([], None, 7)
    every = _rows_of(whole.draft(feeds, [3] * 4))
    assert _rows_of(kept.draft([feeds[2], feeds[0]], [3, 3])) == [every[2], every[0]]


def test_a_captured_row_restores_into_rows_that_draft_what_it_drafts(demo, sequences):
    """capture(row) after a round, then append(RowStart(state=...)) with the sequence since:
    the restored row drafts what the row drafts, and so does a row never captured; a
    per-request source restored from the same state drafts the same too."""
    provider = _provider(demo)
    captured, untouched = provider.open_rows(demo.target), provider.open_rows(demo.target)
    for rows in (captured, untouched):
        rows.append([_start(s, 6) for s in sequences[:3]])
        rows.draft([_feed(s, 6, 8) for s in sequences[:3]], [3, 3, 3])
        rows.commit([1, 1, 1])
    state = captured.capture(1)
    tokens = sequences[1][0]
    restored = provider.open_rows(demo.target)
    restored.append([_start(sequences[0], 5),
                     _start(sequences[1], 12, state=state, state_tokens=tokens[:8])])
    ahead = [_feed(s, 8, 12) for s in sequences[:3]]
    want = _rows_of(captured.draft(ahead, [3, 3, 3]))[1]
    assert want == _rows_of(untouched.draft(ahead, [3, 3, 3]))[1]
    assert _rows_of(restored.draft([_feed(sequences[0], 5, 6), Feed([], None, 12)],
                                   [3, 3]))[1] == want
    source = provider.open(demo.target, Sampler())
    source.restore(state, tokens[:8])
    assert source.draft(ahead[1], 3).tokens[0].tolist() == want


def test_a_state_captured_over_other_tokens_is_refused(demo, sequences):
    provider = _provider(demo)
    rows = provider.open_rows(demo.target)
    rows.append([_start(sequences[0], 6)])
    state = rows.capture(0)
    with pytest.raises(ValueError, match="other tokens"):
        rows.append([_start(sequences[1], 9, state=state, state_tokens=sequences[0][0][:6])])
    assert len(rows.rows) == 1 and rows.cache.rows == 1


def test_a_row_far_behind_starts_over_from_its_last_positions(demo):
    """A feed longer than CATCH_UP_MAX (drafting was off): the row drafts what a row that
    heard only the last CATCH_UP_MAX positions drafts, as the per-request source does."""
    from foretell.spec import CATCH_UP_MAX

    tokens = [(7 * i) % 90 + 5 for i in range(CATCH_UP_MAX + 40)]
    hidden, _ = demo.model.forward(mx.array([tokens], dtype=mx.int32), demo.model.make_caches())
    sequence = (tokens, hidden)
    provider = _provider(demo)
    behind = provider.open_rows(demo.target)
    behind.append([_start(sequence, 8)])
    drafted = _rows_of(behind.draft([_feed(sequence, 8, len(tokens))], [3]))
    assert behind.cache.lengths == [CATCH_UP_MAX]  # the restart's, the chain trimmed off
    fresh = provider.open_rows(demo.target)
    fresh.append([RowStart(feed=Feed(tokens[-CATCH_UP_MAX - 1 :],
                                     hidden[:, -CATCH_UP_MAX - 1 : -1]), sampler=Sampler())])
    assert _rows_of(fresh.draft([Feed([], None, len(tokens))], [3])) == drafted
    source = provider.open(demo.target, Sampler())
    source.prefill(_start(sequence, 8).feed)
    assert source.draft(_feed(sequence, 8, len(tokens)), 3).tokens[0].tolist() == drafted[0]


def test_a_sampled_row_hands_over_the_distributions_its_drafts_came_from(demo, sequences):
    from foretell.spec.contract import usable_distributions

    provider = _provider(demo)
    rows = provider.open_rows(demo.target)
    sampled = Sampler(SamplingConfig(temp=0.8, top_k=20))
    rows.append([_start(sequences[0], 6), _start(sequences[1], 6, sampler=sampled)])
    draft = rows.draft([_feed(s, 6, 8) for s in sequences[:2]], [3, 2])
    assert draft.lengths == (3, 2) and draft.q.shape[:2] == (2, 3)
    q = draft.q
    assert usable_distributions(q[1, :2]).all().item()
    picked = mx.take_along_axis(q[1, :2], draft.tokens[1, :2, None], axis=-1)
    assert (picked > 0).all().item()
    # The greedy row's drafts are point masses on them.
    assert mx.array_equal(mx.argmax(q[0], axis=-1), draft.tokens[0]).item()
    assert (mx.max(q[0], axis=-1) == 1).all().item()


def test_a_batch_speculating_with_mtp_streams_each_request_alone(demo):
    """Rows of different prompt lengths (one of a single token) join at different times and
    leave at different times; each streams plain greedy decoding's tokens alone, the head's
    drafts are often kept, and the group drafts natively."""
    from foretell_qwen.mtp_rows import MTPRows

    prompts = [demo.encode_prompt(t, chat=False) for t in TEXTS[:3]] + [[5]]
    lengths = [40, 24, 33, 16]
    speculator = _speculator(demo)
    scheduler = Scheduler(demo)
    try:
        early = [scheduler.submit(p, max_tokens=n, ignore_eos=True, speculate=speculator)
                 for p, n in zip(prompts[:2], lengths[:2])]
        stream = iter(early[0])
        head = [next(stream) for _ in range(3)]  # rows 0 and 1 are decoding
        late = [scheduler.submit(p, max_tokens=n, ignore_eos=True, speculate=speculator)
                for p, n in zip(prompts[2:], lengths[2:])]
        assert isinstance(scheduler._groups[(id(speculator), False)].rows, MTPRows)
        results = [_streamed(h) for h in [*early, *late]]
    finally:
        scheduler.close()
    results[0] = ([t for e in head for t in e.tokens] + results[0][0], results[0][1])
    drafted = accepted = 0
    for prompt, n, (tokens, stats) in zip(prompts, lengths, results):
        assert tokens == _alone(demo, prompt, max_tokens=n, ignore_eos=True)
        drafted += stats.speculation["drafted"]
        accepted += stats.speculation["accepted"]
    assert accepted / drafted > 0.5


def test_seeded_sampled_rows_speculating_with_mtp_draw_exactly_what_they_draw_alone(demo):
    prompts = [demo.encode_prompt(t, chat=False) for t in TEXTS]
    settings = [SamplingConfig(temp=0.8, seed=3), SamplingConfig(temp=1.0, top_k=20, seed=9),
                SamplingConfig(temp=0.7, top_p=0.9, seed=1), SamplingConfig(temp=1.1, seed=4)]
    speculator = _speculator(demo)
    scheduler = Scheduler(demo)
    try:
        handles = [scheduler.submit(p, max_tokens=20, ignore_eos=True, sampling=s,
                                    speculate=speculator) for p, s in zip(prompts, settings)]
        results = [_streamed(h) for h in handles]
    finally:
        scheduler.close()
    accepted = 0
    for prompt, sampling, (tokens, stats) in zip(prompts, settings, results):
        assert tokens == _alone(demo, prompt, max_tokens=20, ignore_eos=True, sampling=sampling)
        accepted += stats.speculation["accepted"]
    assert accepted > 0
