"""Helpers a draft source uses to draw its drafts with the request's sampling settings.

:class:`Drafting` collects an autoregressive draft token by token (and its ``q``);
:func:`draft_keys` gives a source a random stream of its own. Plugins import both from
:mod:`foretell.spec`.
"""

from __future__ import annotations

import mlx.core as mx

from foretell.sampling import RandomKeys, Sampler, position_keys
from foretell.spec.contract import Draft


class Drafting:
    """Collects one draft token by token for a source that drafts autoregressively:
    ``add(logits)`` picks the next token with the request's sampling settings (the argmax
    when greedy; a draw from the processed distribution, recorded as ``q``, when sampling)
    and returns it as ``[B]``; ``draft()`` is the :class:`Draft` so far.

    Given ``position`` (the feed's, :class:`~foretell.spec.Feed`), a seeded request's
    drafts are drawn with the noise the verifier draws those positions' tokens with (still
    draws from ``q``), so a draft is kept whenever the drafter's distribution picks what the
    target's does; otherwise, and unseeded, with ``keys``, a stream of the drafter's own."""

    def __init__(self, sampler: Sampler, keys: RandomKeys | None, position: int | None = None):
        self.sampler, self.keys = sampler, keys
        seed = sampler.config.seed
        self._at = position if position is not None and seed is not None else None
        self._tokens: list[mx.array] = []
        self._q: list[mx.array] = []

    def add(self, logits: mx.array) -> mx.array:
        scores = self.sampler.scores(logits)
        if self.sampler.greedy:
            key = None
        elif self._at is not None:
            key = position_keys(self.sampler.config.seed, self._at + len(self._tokens))
            key = mx.broadcast_to(key, (scores.shape[0], 2))
        else:
            key = self.keys.next() if self.keys is not None else None
        token = self.sampler.sample(scores, key)
        if not self.sampler.greedy:
            self._q.append(self.sampler.probabilities(scores))
        self._tokens.append(token)
        return token

    def draft(self) -> Draft:
        q = mx.stack(self._q, axis=1) if self._q else None
        return Draft(mx.stack(self._tokens, axis=1), q)


def draft_keys(sampler: Sampler) -> RandomKeys | None:
    """A random stream for a drafter's own sampling, independent of the verifier's draws
    (sharing them would correlate acceptance with the draft and bias the output)."""
    if sampler.greedy:
        return None
    seed = sampler.config.seed
    return RandomKeys(None if seed is None else (seed * 2654435761 + 97) % (1 << 63))
