"""The two-model drafter over rows (plugin API 2): one draft-model forward per drafted token
for every row of the batch at once.

Each row keeps what the per-request source keeps (``source.py``): its sequence, and how much
of it plus which drafts its row of the draft caches holds. Rows joining together prefill
their prompts in one forward (a chunk of tokens at a time), padded as a round is. A round
feeds every row the tokens its caches lack (rows lacking fewer are padded and the padding
trimmed back), then chains the drafts; ``commit`` trims each row back to its accepted drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from foretell.model import BatchKVCache, batch_caches
from foretell.request import prefill, prefill_rows
from foretell.spec import (
    CATCH_UP_MAX,
    Drafting,
    DraftState,
    Feed,
    RowDraft,
    RowStart,
    resumed_keys,
)


class _Row:
    def __init__(self, start: RowStart) -> None:
        self.sampler, self.keys = start.sampler, start.keys
        self.sequence: list[int] = []
        #: The row's draft caches hold ``sequence[base:fed]``, then the drafts fed this round.
        self.base = 0
        self.fed = 0


class TwoModelRows:
    """:class:`foretell.spec.rows.DraftRows` for one draft model."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.caches: list[BatchKVCache] = batch_caches(model)
        if not getattr(self.caches[0], "trims_rows", True):
            # Rows' drafts are trimmed apart every round (padding, rejections).
            raise TypeError(f"{model.model_type}: the draft model's batch cannot roll its "
                            "rows back by different counts")
        self.rows: list[_Row] = []
        self._drafted = 0  # drafts chained this round, every row alike

    def append(self, starts: Sequence[RowStart]) -> None:
        # Every new row is built before any joins: a state that does not fit raises with the
        # rows as they were, and the core appends that row again without it.
        rows, singles = [], []
        for start in starts:
            row = _Row(start)
            caches = self._restored(row, start) if start.state is not None else None
            singles.append(caches if caches is not None else self.model.make_caches())
            row.sequence = list(start.feed.tokens)
            rows.append(row)
        todo = [row.sequence[row.fed : -1] for row in rows]
        if len(rows) == 1:
            prefill(self.model, todo[0], singles[0])
        elif any(todo):
            singles, _ = prefill_rows(self.model, todo, singles)
            mx.eval([cache.state for caches in singles for cache in caches])
        for row, tokens in zip(rows, todo):
            row.fed += len(tokens)
        for layer, cache in enumerate(self.caches):
            cache.append([caches[layer] for caches in singles])
        self.rows.extend(rows)

    def _restored(self, row: _Row, start: RowStart) -> list[Any]:
        state = start.state
        fed, base = int(state.meta["fed"]), int(state.meta.get("base", 0))
        caches = list(state.caches)
        if len(caches) != len(self.caches) or any(c.offset != fed - base for c in caches):
            raise ValueError(f"stored draft caches ({len(caches)} layers) do not fit this "
                             f"draft model ({len(self.caches)} layers) at tokens {base}-{fed}")
        row.fed, row.base = fed, base
        row.keys = resumed_keys(row.keys, state)
        return caches

    def filter(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        for cache in self.caches:
            cache.filter(keep)

    def draft(self, feeds: Sequence[Feed], lengths: Sequence[int]) -> RowDraft:
        n = max(lengths, default=0)
        for row, feed in zip(self.rows, feeds):
            row.sequence.extend(feed.tokens)
            if len(row.sequence) - row.fed > CATCH_UP_MAX:  # start over on the newest tokens
                row.base = row.fed = len(row.sequence) - CATCH_UP_MAX
                self._trim_row(self.rows.index(row), None)
        if n == 0:
            self._drafted = 0
            return RowDraft.of([[] for _ in self.rows])
        todo = [row.sequence[row.fed :] for row in self.rows]
        width = max(len(t) for t in todo)
        tokens = mx.array([t + [0] * (width - len(t)) for t in todo], dtype=mx.int32)
        hidden, _ = self.model.forward(tokens, self.caches)
        last = mx.array([len(t) - 1 for t in todo], dtype=mx.int32)
        logits = self.model.logits(mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
        for cache in self.caches:  # the padding leaves each row's caches
            cache.trim([width - len(t) for t in todo])
        draftings = [Drafting(row.sampler, row.keys, feed.position)
                     for row, feed in zip(self.rows, feeds)]
        token = self._draw(draftings, logits)
        for _ in range(n - 1):
            hidden, _ = self.model.forward(token[:, None], self.caches)
            token = self._draw(draftings, self.model.logits(hidden[:, -1, :]))
        for row in self.rows:  # the last draft was not fed
            row.fed = len(row.sequence) + n - 1
        self._drafted = n
        drafts = [d.draft() for d in draftings]
        q = None
        if any(d.q is not None for d in drafts):
            vocab = self.model.vocab_size
            q = mx.concatenate([d.q if d.q is not None else (
                mx.arange(vocab)[None, None, :] == d.tokens[..., None]).astype(mx.float32)
                for d in drafts], axis=0)
        return RowDraft(mx.concatenate([d.tokens for d in drafts], axis=0),
                        tuple(min(k, n) for k in lengths), q)

    @staticmethod
    def _draw(draftings: list[Drafting], logits: mx.array) -> mx.array:
        """Each row's next draft by its own request's sampling, as ``[B]``."""
        return mx.concatenate([d.add(logits[b : b + 1]) for b, d in enumerate(draftings)])

    def commit(self, accepted: Sequence[int]) -> None:
        fed_drafts = max(self._drafted - 1, 0)
        keep = [min(a, fed_drafts) for a in accepted]
        if fed_drafts:
            for cache in self.caches:
                cache.trim([fed_drafts - k for k in keep])
        for row, k in zip(self.rows, keep):
            row.fed = row.fed - fed_drafts + k
        self._drafted = 0

    def capture(self, row: int) -> DraftState:
        r = self.rows[row]
        return DraftState(caches=[cache.extract(row) for cache in self.caches],
                          meta={"fed": r.fed, "base": r.base},
                          keys=r.keys.state() if r.keys is not None else None)

    def close(self) -> None:
        self.rows = []
        self.caches = batch_caches(self.model)

    def _trim_row(self, index: int, count: int | None) -> None:
        """Drop ``count`` of row ``index``'s newest tokens (None: all of them)."""
        for cache in self.caches:
            counts = [0] * len(self.rows)
            counts[index] = cache.lengths[index] if count is None else count
            cache.trim(counts)
