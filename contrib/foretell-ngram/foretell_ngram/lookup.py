"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the
sequence's own suffix (prompt and output alike).

The index is incremental: for every n-gram size it maps each n-gram to the position right
after its latest occurrence, so a draft costs O(max_ngram) dictionary lookups however long
the history is (a rescan grew with it).

How far to trust a match is read from its depth, since deeper matches are kept far more
often (docs/decisions.md): a suffix matched ``s < max_ngram`` tokens deep proposes at most
``tokens_per_match * s`` tokens, a full-depth match (a copy span) all the verifier asks for.
"""

from __future__ import annotations

import mlx.core as mx

from foretell.spec import Draft, DraftState, Feed


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

    def followers(self) -> dict[int, list[int]]:
        """Per n-gram size, the follower positions the index holds; with the history they
        are the whole index (each key is the n-gram just before its position)."""
        return {size: sorted(table.values()) for size, table in self._follow.items()}

    def restore(self, history: list[int], followers: dict[int, list[int]]) -> None:
        """Become the index of ``history`` whose :meth:`followers` were ``followers``."""
        h = list(history)
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
        # Empty tables are left out: a zero-length tensor carries nothing.
        tensors = {f"follow.{size}": mx.array(positions, dtype=mx.int32)
                   for size, positions in self.index.followers().items() if positions}
        return DraftState(tensors=tensors, meta={"tokens": len(self.history)})

    def restore(self, state: DraftState, tokens: list[int]) -> None:
        if len(tokens) != state.meta["tokens"]:
            raise ValueError(f"the stored index covers {state.meta['tokens']} tokens, "
                             f"restore was given {len(tokens)}")
        followers = {int(name.split(".")[1]): t.tolist() for name, t in state.tensors.items()
                     if name.startswith("follow.")}
        self.index.restore(tokens, followers)

    def close(self) -> None:
        self.index = NgramIndex(1, 1)
