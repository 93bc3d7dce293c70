"""How many tokens to draft each round, from what this machine and this drafter measure.

A round that drafts ``k`` tokens costs ``T(k)`` seconds and yields ``E(k) = 1 + sum over
j <= k of prod over i <= j of a_i`` tokens, where ``a_i`` is the measured chance that
draft position ``i`` is accepted once every earlier one was. The policy picks the ``k`` in
``0..max_k`` with the best ``E(k) / T(k)``; ``k = 0`` is a plain decoding step, so a drafter
that does not pay is switched off rather than slowing the request down.

``T`` is a straight line ``c0 + c1 * n`` (n = tokens actually drafted) fitted to the
round times seen so far, with old rounds fading, so it follows what the machine does now
(a GPU where verifying 8 tokens costs little more than 1, a CPU where drafting costs the
draft model's compute). Until both a plain and a drafted round have been timed, the
policy drafts ``max_k``; afterwards it probes a neighbouring ``k`` now and then so its
picture stays current.
"""

from __future__ import annotations

#: Weight kept by old observations per new one (a memory of about 50 rounds).
DECAY = 0.98
#: Every this many rounds, try a k other than the best one.
PROBE_EVERY = 16


class DraftLengthPolicy:
    def __init__(self, max_k: int, *, adaptive: bool = True):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.adaptive = adaptive
        # Beta(1, 1) prior on each position's acceptance.
        self._offered = [2.0] * max_k
        self._accepted = [1.0] * max_k
        # Weighted sums for the least-squares line T(n) = c0 + c1 n.
        self._w = self._wn = self._wnn = self._wt = self._wnt = 0.0
        self._plain_seen = self._drafted_seen = False
        self._rounds = 0
        self._best = max_k

    # -- the model --------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        return [a / o for a, o in zip(self._accepted, self._offered)]

    def expected_tokens(self, k: int) -> float:
        total, chain = 1.0, 1.0
        for rate in self.acceptance()[:k]:
            chain *= rate
            total += chain
        return total

    def round_time(self, n: int) -> float | None:
        """The fitted seconds of a round drafting ``n`` tokens, or None before a fit."""
        if not (self._plain_seen and self._drafted_seen):
            return None
        det = self._w * self._wnn - self._wn**2
        if det <= 1e-12:
            return None
        c1 = (self._w * self._wnt - self._wn * self._wt) / det
        c0 = (self._wt - c1 * self._wn) / self._w
        return max(c0 + max(c1, 0.0) * n, 1e-9)

    # -- the loop ---------------------------------------------------------------------

    def choose(self, limit: int) -> int:
        """Tokens to ask the drafter for this round, at most ``limit``."""
        self._rounds += 1
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        if not self.adaptive:
            return limit
        if not self._drafted_seen:
            return limit
        if not self._plain_seen:
            return 0
        rates = [self.expected_tokens(k) / self.round_time(k) for k in range(self.max_k + 1)]
        self._best = max(range(self.max_k + 1), key=rates.__getitem__)
        k = self._best
        if self._rounds % PROBE_EVERY == 0:
            k = self._best - 1 if self._best == self.max_k else self._best + 1
        return min(k, limit)

    def observe(self, drafted: int, accepted: int, seconds: float) -> None:
        """A round drafted ``drafted`` tokens, the target kept ``accepted``, in ``seconds``."""
        for i in range(drafted):
            self._offered[i] = self._offered[i] * DECAY + 1.0
            self._accepted[i] = self._accepted[i] * DECAY + (1.0 if i < accepted else 0.0)
            if i >= accepted:
                break
        n = float(drafted)
        self._w = self._w * DECAY + 1.0
        self._wn = self._wn * DECAY + n
        self._wnn = self._wnn * DECAY + n * n
        self._wt = self._wt * DECAY + seconds
        self._wnt = self._wnt * DECAY + n * seconds
        if drafted:
            self._drafted_seen = True
        else:
            self._plain_seen = True
