"""What a drafter hears in a batch: each row's feeds, joined, are exactly its sequence, every
token once, in order, whether the row drafted that round or not (a row asked for 0 tokens
takes its feed too), for a drafter on rows (plugin API 2) and for a per-request one served
through :class:`~foretell.spec.batch.SourceRows`."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
from spec_helpers import RecordingRows

from foretell.sampling import Sampler
from foretell.spec import Draft, Feed
from foretell.spec.batch import DraftGroup


class _RecordingSource:
    def __init__(self, heard: list[int]) -> None:
        self.heard = heard

    def prefill(self, feed):
        self.heard.extend(feed.tokens)

    def draft(self, feed, n):
        self.heard.extend(feed.tokens)
        return Draft.of([0] * n)

    def commit(self, accepted):
        pass

    def close(self):
        pass


class _RowsProvider:
    requires = frozenset()

    def __init__(self) -> None:
        self.rows = RecordingRows()

    def open_rows(self, target):
        return self.rows


class _SourceProvider:
    requires = frozenset()

    def __init__(self) -> None:
        self.heard: list[list[int]] = []

    def open(self, target, sampler):
        self.heard.append([])
        return _RecordingSource(self.heard[-1])


def _member(prompt):
    return SimpleNamespace(state=SimpleNamespace(prompt=list(prompt), generated=[]),
                           sampler=Sampler(), feed_hidden=[])


def _rounds(provider):
    """Two rows; the first asked for 0 tokens in the middle round while the second drafts."""
    speculator = SimpleNamespace(provider=provider, wants_hidden=False, label=lambda: "rec")
    target = SimpleNamespace(model=SimpleNamespace(vocab_size=100))
    group = DraftGroup(speculator, target)
    rows = [_member([1, 2, 3]), _member([9])]
    assert group.add(rows) == [True, True]
    for step, asked in enumerate(([2, 2], [0, 2], [2, 2], [1, 0])):
        group.draft(rows, list(asked))
        group.commit(rows, [0, 0], list(asked))
        for b, row in enumerate(rows):
            token = 10 * (step + 1) + b
            row.state.generated.append(token)
    group.draft(rows, [1, 1])
    return [r.state.prompt + r.state.generated for r in rows]


def test_a_rows_drafter_hears_each_rows_sequence_once_drafting_or_not():
    provider = _RowsProvider()
    sequences = _rounds(provider)
    assert provider.rows.heard == sequences


def test_a_per_request_source_hears_what_it_missed_while_not_drafting():
    provider = _SourceProvider()
    sequences = _rounds(provider)
    assert provider.heard == sequences


def test_feed_hidden_states_of_rounds_not_drafted_arrive_with_the_next_feed():
    from foretell.spec.batch import _after

    earlier = Feed([4, 5], mx.ones((1, 2, 3)), 7)
    later = Feed([6], mx.zeros((1, 1, 3)), 8)
    joined = _after(earlier, later)
    assert joined.tokens == [4, 5, 6] and joined.position == 8
    assert joined.hidden.shape == (1, 3, 3)
    assert joined.hidden[0, :, 0].tolist() == [1.0, 1.0, 0.0]
