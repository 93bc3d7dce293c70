"""Qwen-MTP over rows (plugin API 2): the head drafts every row of a batch at once.

The head has one attention layer, so the rows share one :class:`BatchKVCache`. Rows joining
together absorb their prompts in one head forward (a chunk of positions at a time). A round
absorbs every row's feed in one head forward (each row's tokens paired with the target's
states as :class:`~foretell_qwen.mtp.MTPSource` pairs them; shorter feeds padded, the
padding trimmed back per row), then chains the drafts with one head forward per drafted
token for all rows. The chained positions saw the head's own output in place of the
target's state, so they leave the cache once the drafts are drawn: the real states of the
kept tokens arrive in the next feed. A row the head has heard no state of yet (a one-token
prompt before its first step) drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from foretell.model import BatchKVCache, KVCache, fixed_or_ordinary
from foretell.spec import (
    CATCH_UP_MAX,
    Drafting,
    DraftState,
    Feed,
    RowDraft,
    RowStart,
    resumed_keys,
)
from foretell_qwen.mtp import CHUNK, MTPHead, ShortlistHead, absorb, head_forward, paired


class _Row:
    def __init__(self, start: RowStart) -> None:
        self.sampler, self.keys = start.sampler, start.keys
        #: Whether the head absorbed a position of this row (its ``last`` is real).
        self.ready = False


class MTPRows:
    """:class:`foretell.spec.rows.DraftRows` for a target's MTP head."""

    def __init__(self, head: MTPHead, target: Any, shortlist: ShortlistHead | None = None):
        self.head = head
        self.target = target
        self.logits = shortlist or ShortlistHead(target, 0)
        self.cache = BatchKVCache()
        self.rows: list[_Row] = []
        #: ``[B, 1, H]``: the head's output at each row's newest absorbed position (it
        #: predicts what follows the row's sequence; zeros for a row not ready), or None
        #: while no row has one.
        self.last: mx.array | None = None

    # -- rows joining and leaving ----------------------------------------------------------

    def append(self, starts: Sequence[RowStart]) -> None:
        # Every new row is built before any joins: a state that does not fit raises with the
        # rows as they were, and the core appends that row again without it.
        joined = [self._start(start) for start in starts]
        if not joined:
            return
        if len(joined) == 1:
            row, single, last, (tokens, hidden) = joined[0]
            newest = absorb(lambda e, h: self.head(e, h, single), self.target.embed, tokens,
                            hidden)
            joined = [(row, single, newest if newest is not None else last)]
        else:
            joined = self._absorbed_together(joined)
        for row, single, last in joined:
            if last is not None:
                mx.eval(last, *single.state)
            row.ready = last is not None
        lasts = [last for _, _, last in joined]
        known = [x for x in (self.last, *lasts) if x is not None]
        if known:
            like = known[0]
            zero = mx.zeros((1, 1, like.shape[-1]), like.dtype)
            parts = [self.last if self.last is not None
                     else mx.zeros((len(self.rows), 1, like.shape[-1]), like.dtype)]
            parts += [zero if last is None else last.astype(like.dtype) for last in lasts]
            self.last = mx.concatenate([p for p in parts if p.shape[0]], axis=0)
        self.cache.append([single for _, single, _ in joined])
        self.rows.extend(row for row, _, _ in joined)

    def _start(self, start: RowStart) -> tuple[_Row, KVCache, mx.array | None,
                                               tuple[list[int], mx.array | None]]:
        """A joining row, its head cache and newest output (restored from ``start.state``
        when given) and the positions of ``start.feed`` it has yet to absorb."""
        row = _Row(start)
        single, last, fed = KVCache(), None, 0
        if start.state is not None:
            fed = len(start.state_tokens)
            if list(start.feed.tokens[:fed]) != list(start.state_tokens):
                raise ValueError("the stored MTP head state was captured over other tokens "
                                 "than this row's sequence begins with")
            single, last = self._restored(start.state)
            row.keys = resumed_keys(row.keys, start.state)
        return row, single, last, paired(start.feed.tokens[fed:], start.feed.hidden)

    def _absorbed_together(self, joined: list[Any]) -> list[tuple[_Row, Any, mx.array | None]]:
        """Every joining row's positions through the head in one forward per chunk (the
        shorter padded, the padding trimmed off): each row, its head cache and newest
        output."""
        pairs = [pair for *_, pair in joined]
        width = max(len(tokens) for tokens, _ in pairs)
        if not width:
            return [(row, single, last) for row, single, last, _ in joined]
        like = next(hidden for _, hidden in pairs if hidden is not None)
        ids = mx.array([t + [0] * (width - len(t)) for t, _ in pairs], dtype=mx.int32)
        states = mx.concatenate([
            mx.zeros((1, width, like.shape[-1]), like.dtype) if h is None
            else mx.pad(h, [(0, 0), (0, width - h.shape[1]), (0, 0)]) for _, h in pairs])
        cache = BatchKVCache()
        cache.append([single for _, single, _, _ in joined])
        newest: list[mx.array | None] = [None] * len(joined)
        step = max(1, CHUNK // len(joined))  # a lone row's positions per forward
        for lo in range(0, width, step):
            out = self.head(self.target.embed(ids[:, lo : lo + step]), states[:, lo : lo + step],
                            cache)
            for b, (tokens, _) in enumerate(pairs):
                if lo < len(tokens) <= lo + step:  # the row's newest position is here
                    newest[b] = out[b : b + 1, len(tokens) - 1 - lo :][:, :1]
            mx.eval(cache.buffers if cache.buffers is not None else out,
                    [n for n in newest if n is not None])
        cache.trim([width - len(tokens) for tokens, _ in pairs])
        return [(row, cache.extract(b), newest[b] if newest[b] is not None else last)
                for b, (row, _, last, _) in enumerate(joined)]

    def _restored(self, state: DraftState) -> tuple[KVCache, mx.array | None]:
        caches = list(state.caches)
        attention = self.head.layers[0].self_attn
        heads, dim = attention.n_kv_heads, attention.k_norm.weight.shape[0]
        hidden = self.head.norm.weight.shape[0]
        if len(caches) != 1 or not isinstance(caches[0], KVCache):
            raise ValueError(f"the MTP head has one full-attention layer; the stored state "
                             f"holds {[type(c).__name__ for c in caches]}")
        keys = caches[0].state
        if keys and (keys[0].shape[1], keys[0].shape[3]) != (heads, dim):
            raise ValueError(f"the stored MTP head cache holds {keys[0].shape[1]} kv heads of "
                             f"{keys[0].shape[3]}; this head has {heads} of {dim}")
        last = state.tensors.get("last")
        if last is not None and tuple(last.shape) != (1, 1, hidden):
            raise ValueError(f"the stored MTP head output is {list(last.shape)}, this head's "
                             f"is [1, 1, {hidden}]")
        single = KVCache()
        single.state = keys  # views: writes go to a fresh buffer, the donor stays as it was
        return single, last

    def filter(self, keep: Sequence[int]) -> None:
        keep = list(keep)
        self.rows = [self.rows[i] for i in keep]
        self.cache.filter(keep)
        if self.last is not None:
            self.last = mx.take(self.last, mx.array(keep, dtype=mx.int32), axis=0) \
                if keep else None

    # -- rounds ------------------------------------------------------------------------------

    def draft(self, feeds: Sequence[Feed], lengths: Sequence[int]) -> RowDraft:
        self._absorb(feeds)
        lengths = [n if row.ready else 0 for row, n in zip(self.rows, lengths)]
        n = max(lengths, default=0)
        if n == 0:
            return RowDraft.of([[] for _ in self.rows])
        sampled = {b: Drafting(row.sampler, row.keys, feed.position)
                   for b, (row, feed, k) in enumerate(zip(self.rows, feeds, lengths))
                   if k and not row.sampler.greedy}
        out, steps = self.last, []
        for i in range(n):
            logits = self.logits(out[:, -1, :])
            # Greedy rows' drafts (and a filler for rows past their length), then each
            # sampled row's draw by its own request's settings and keys.
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
            drawing = [b for b in sampled if i < lengths[b]]
            if drawing:
                token = mx.concatenate([
                    sampled[b].add(logits[b : b + 1]).astype(mx.int32) if b in drawing
                    else token[b : b + 1] for b in range(len(self.rows))])
            steps.append(token)
            if i < n - 1:
                out = self.head(self.target.embed(token[:, None]), out, self.cache)
        if n > 1:
            self.cache.trim([n - 1] * len(self.rows))
        tokens = mx.stack(steps, axis=1)
        q = None
        if sampled:
            vocab = self.target.vocab_size
            q = mx.concatenate([
                _padded(sampled[b].draft().q, n) if b in sampled
                else (mx.arange(vocab)[None, None, :] == tokens[b : b + 1, :, None]
                      ).astype(mx.float32)
                for b in range(len(self.rows))], axis=0)
        return RowDraft(tokens, tuple(lengths), q)

    def _absorb(self, feeds: Sequence[Feed]) -> None:
        """Every row's feed through the head in one forward (rows whose feed carries no
        state of the target take only padding)."""
        pairs, restart = [], [0] * len(self.rows)
        for b, (row, feed) in enumerate(zip(self.rows, feeds)):
            tokens, hidden = feed.tokens, feed.hidden
            if len(tokens) > CATCH_UP_MAX:
                # Drafting was off: the row starts over from its last CATCH_UP_MAX positions
                # as MTPSource does (foretell.spec.CATCH_UP_MAX).
                restart[b], row.ready = self.cache.lengths[b], False
                hidden = hidden[:, -CATCH_UP_MAX:] if hidden is not None else None
            pairs.append(paired(tokens, hidden))
        if any(restart):
            self.cache.trim(restart)
        width = max((len(t) for t, _ in pairs), default=0)
        if not width:
            return
        like = next(h for _, h in pairs if h is not None)
        ids = mx.array([t + [0] * (width - len(t)) for t, _ in pairs], dtype=mx.int32)
        states = mx.concatenate([
            mx.zeros((1, width, like.shape[-1]), like.dtype) if h is None
            else h if len(t) == width else mx.pad(h, [(0, 0), (0, width - len(t)), (0, 0)])
            for t, h in pairs], axis=0)
        # As MTPSource absorbs: over fixed shapes where the rows allow it (one row).
        out, = fixed_or_ordinary(self.head, "MTP head", head_forward, self.target.embed(ids),
                                 states, caches=[self.cache])
        self.cache.trim([width - len(t) for t, _ in pairs])
        newest = mx.take_along_axis(
            out, mx.array([max(len(t) - 1, 0) for t, _ in pairs], dtype=mx.int32)[:, None, None],
            axis=1)
        got = [len(t) > 0 for t, _ in pairs]
        if all(got):
            self.last = newest
        else:
            kept = self.last if self.last is not None else mx.zeros_like(newest)
            self.last = mx.where(mx.array(got)[:, None, None], newest, kept)
        for row, heard in zip(self.rows, got):
            row.ready = row.ready or heard

    def commit(self, accepted: Sequence[int]) -> None:
        # Nothing to roll back: the chained positions left the cache when the drafts were
        # drawn, and the kept drafts come back in the next feed with the target's states.
        pass

    def capture(self, row: int) -> DraftState:
        r = self.rows[row]
        tensors = {"last": self.last[row : row + 1]} if r.ready else {}
        cache = self.cache.extract(row)
        # The cache tier may read the state on another thread: hand it over computed.
        mx.eval(*cache.state, *tensors.values())
        return DraftState(caches=[cache], tensors=tensors,
                          keys=r.keys.state() if r.keys is not None else None)

    def close(self) -> None:
        self.rows = []
        self.cache = BatchKVCache()
        self.last = None


def _padded(q: mx.array, n: int) -> mx.array:
    """``q`` ``[1, k, V]`` with zero rows up to ``n`` (never read: lengths cap every row)."""
    return q if q.shape[1] == n else mx.pad(q, [(0, 0), (0, n - q.shape[1]), (0, 0)])
