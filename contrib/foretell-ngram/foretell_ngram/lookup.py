"""Prompt-lookup drafting: match the sequence's suffix against its own history."""

from __future__ import annotations


class NgramProvider:
    """Server-lifetime provider; holds no weights, so ``open`` is cheap."""

    def __init__(self, config):
        self.config = config

    def open(self, target=None, sampler=None) -> NgramSource:
        return NgramSource(self.config.max_ngram, self.config.min_ngram)


class NgramSource:
    """Per-request drafting state: the token history seen so far."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []

    def prefill(self, prompt: list[int]) -> None:
        self.history = list(prompt)

    def draft(self, feed: list[int], n: int, step: int = 0) -> list[int]:
        """Append ``feed`` (tokens the target accepted since the last call) and propose up
        to ``n`` tokens; the returned length is authoritative (possibly 0)."""
        self.history.extend(feed)
        h = self.history
        for size in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            suffix = h[-size:]
            # The most recent earlier occurrence predicts best on self-repeating text.
            for start in range(len(h) - size - 1, -1, -1):
                if h[start : start + size] == suffix:
                    follow = h[start + size : start + size + n]
                    if follow:
                        return follow
        return []

    def commit(self, drafted: list[int], accepted: int) -> None:
        # Accepted tokens arrive again through the next ``feed``; nothing to roll back.
        pass

    def close(self) -> None:
        self.history = []
