"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the
sequence's own suffix (prompt and output alike).

The index is incremental: for every n-gram size it maps each n-gram to the position right
after its latest occurrence, so a draft costs O(max_ngram) dictionary lookups however long
the history is (a rescan grew with it).

How far to trust a match is read from its depth, since deeper matches are kept far more
often (docs/decisions.md): a suffix matched ``s < max_ngram`` tokens deep proposes at most
``tokens_per_match * s`` tokens, a full-depth match (a copy span) all the verifier asks for.

One request drafts through an :class:`NgramSource` (plugin API 1), the rows of a batch
through one :class:`NgramRows` (plugin API 2); both keep an :class:`NgramIndex` per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from foretell.spec import Draft, DraftState, Feed, RowDraft, RowStart


class NgramProvider:
    """Server-lifetime provider; holds no weights, so ``prepare`` and ``open`` are cheap."""

    requires = frozenset()
    #: Up to 16 a round unless told: a lookup costs nothing to draft and a copy span runs
    #: long; verifying 16 tokens cost about 1.6 plain steps on the 2-core CPU.
    draft_tokens = 16

    def __init__(self, config):
        self.config = config

    def prepare(self, target) -> None:
        pass

    def draft_identity(self) -> dict:
        # The n-gram sizes decide what the index holds (how much a match proposes does not).
        return {"max_ngram": self.config.max_ngram, "min_ngram": self.config.min_ngram,
                "version": 1}

    def open(self, target=None, sampler=None) -> NgramSource:
        c = self.config
        return NgramSource(c.max_ngram, c.min_ngram, c.tokens_per_match)

    def open_rows(self, target=None) -> NgramRows:
        c = self.config
        return NgramRows(c.max_ngram, c.min_ngram, c.tokens_per_match)


class NgramIndex:
    """The token history and, per n-gram size, where each n-gram last ended."""

    def __init__(self, max_ngram: int, min_ngram: int, tokens_per_match: int = 0):
        self.sizes = range(min_ngram, max_ngram + 1)
        self.max_ngram = max_ngram
        #: Tokens proposed per matched token below ``max_ngram``; 0: no limit.
        self.tokens_per_match = tokens_per_match
        self.history: list[int] = []
        # follow[size][ngram] = index of the token after that n-gram's latest occurrence,
        # among occurrences that have a following token.
        self._follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def extend(self, tokens: list[int]) -> None:
        h = self.history
        follow = [(size, self._follow[size]) for size in self.sizes]
        for token in tokens:
            # The n-grams ending at the current last token now have a follower.
            end = len(h)
            for size, table in follow:
                if end >= size:
                    table[tuple(h[end - size : end])] = end
            h.append(token)

    def capture(self) -> DraftState:
        """The index as a state: per n-gram size the follower positions it holds, which with
        the history are the whole index (each key is the n-gram just before its position)."""
        # Empty tables are left out: a zero-length tensor carries nothing.
        tensors = {f"follow.{size}": mx.array(sorted(table.values()), dtype=mx.int32)
                   for size, table in self._follow.items() if table}
        return DraftState(tensors=tensors, meta={"tokens": len(self.history)})

    def restore(self, state: DraftState, tokens: list[int]) -> None:
        """Become the index :meth:`capture` returned ``state`` of, over ``tokens`` (the
        history it was captured at), without re-indexing them."""
        if len(tokens) != state.meta["tokens"]:
            raise ValueError(f"the stored index covers {state.meta['tokens']} tokens, "
                             f"restore was given {len(tokens)}")
        followers = {int(name.split(".")[1]): t.tolist() for name, t in state.tensors.items()
                     if name.startswith("follow.")}
        h = list(tokens)
        self._follow = {size: {tuple(h[p - size : p]): p for p in followers.get(size, ())}
                        for size in self.sizes}
        self.history = h

    def propose(self, n: int) -> list[int]:
        h = self.history
        for size in reversed(self.sizes):
            if len(h) < size:
                continue
            start = self._follow[size].get(tuple(h[len(h) - size :]))
            if start is not None:
                if self.tokens_per_match and size < self.max_ngram:
                    n = min(n, self.tokens_per_match * size)
                return h[start : start + n]
        return []


class NgramSource:
    """Per-request drafting state."""

    def __init__(self, max_ngram: int, min_ngram: int, tokens_per_match: int = 0):
        self.index = NgramIndex(max_ngram, min_ngram, tokens_per_match)

    @property
    def history(self) -> list[int]:
        return self.index.history

    def prefill(self, feed: Feed) -> None:
        self.index.extend(feed.tokens)

    def draft(self, feed: Feed, n: int) -> Draft:
        self.index.extend(feed.tokens)
        return Draft.of(self.index.propose(n))

    def commit(self, accepted: int) -> None:
        # Accepted tokens arrive again through the next feed; nothing was built from drafts.
        pass

    def capture(self) -> DraftState:
        return self.index.capture()

    def restore(self, state: DraftState, tokens: list[int]) -> None:
        self.index.restore(state, tokens)

    def close(self) -> None:
        self.index = NgramIndex(1, 1)


class NgramRows:
    """The rows of a batch (:class:`foretell.spec.DraftRows`): an :class:`NgramIndex` per row,
    all on the host, so a round is a few dictionary lookups per row and one small array."""

    def __init__(self, max_ngram: int, min_ngram: int, tokens_per_match: int = 0):
        self._sizes = (max_ngram, min_ngram, tokens_per_match)
        self.rows: list[NgramIndex] = []

    def append(self, starts: Sequence[RowStart]) -> None:
        # Every new row is built before any joins: a state that does not fit raises with the
        # rows as they were, and the core appends that row again without it.
        joined = []
        for start in starts:
            index = NgramIndex(*self._sizes)
            tokens = list(start.feed.tokens)
            if start.state is not None:
                index.restore(start.state, list(start.state_tokens))
                tokens = tokens[len(start.state_tokens) :]
            index.extend(tokens)
            joined.append(index)
        self.rows.extend(joined)

    def filter(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def draft(self, feeds: Sequence[Feed], lengths: Sequence[int]) -> RowDraft:
        proposals = []
        for index, feed, n in zip(self.rows, feeds, lengths):
            index.extend(feed.tokens)
            proposals.append(index.propose(n) if n else [])
        return RowDraft.of(proposals)

    def commit(self, accepted: Sequence[int]) -> None:
        # Each index holds only fed tokens, never proposals: the accepted ones and the
        # target's correction arrive in the next feed, so there is nothing to roll back.
        pass

    def capture(self, row: int) -> DraftState:
        return self.rows[row].capture()

    def close(self) -> None:
        self.rows = []
