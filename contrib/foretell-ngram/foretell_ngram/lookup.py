"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the
sequence's own suffix (prompt and output alike).

The index is incremental: for every n-gram size it maps each n-gram to the position right
after its latest occurrence, updated as tokens arrive, so a draft costs O(max_ngram)
dictionary lookups however long the history is (the old rescan cost 14.8 ms per draft at
32k tokens).
"""

from __future__ import annotations

from foretell.spec import Draft, Feed


class NgramProvider:
    """Server-lifetime provider; holds no weights, so ``prepare`` and ``open`` are cheap."""

    requires = frozenset()

    def __init__(self, config):
        self.config = config

    def prepare(self, target) -> None:
        pass

    def open(self, target=None, sampler=None) -> NgramSource:
        return NgramSource(self.config.max_ngram, self.config.min_ngram)


class NgramIndex:
    """The token history and, per n-gram size, where each n-gram last ended."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.sizes = range(min_ngram, max_ngram + 1)
        self.history: list[int] = []
        # follow[size][ngram] = index of the token after that n-gram's latest occurrence,
        # among occurrences that have a following token.
        self._follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def extend(self, tokens: list[int]) -> None:
        h = self.history
        for token in tokens:
            # The n-grams ending at the current last token now have a follower.
            end = len(h)
            for size in self.sizes:
                if end >= size:
                    self._follow[size][tuple(h[end - size : end])] = end
            h.append(token)

    def propose(self, n: int) -> list[int]:
        h = self.history
        for size in reversed(self.sizes):
            if len(h) < size:
                continue
            start = self._follow[size].get(tuple(h[len(h) - size :]))
            if start is not None:
                return h[start : start + n]
        return []


class NgramSource:
    """Per-request drafting state."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.index = NgramIndex(max_ngram, min_ngram)

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

    def close(self) -> None:
        self.index = NgramIndex(1, 1)
