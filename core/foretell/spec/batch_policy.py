"""How far a batch's rows draft each step: acceptance learned per row, cost per batch shape.

Each step the scheduler asks for every row's draft length. A row's acceptance rate is
estimated from its own rounds with a prior worth a few rounds (a few rejections at a
request's start do not condemn its drafter); a step's cost is measured per batch shape
``(rows, width)`` as the median of its recent timings (one noisy step moves nothing). The
width chosen maximizes the expected tokens the step produces per second, plain decoding
(width 0) included, so where a batch is large enough that verifying drafts costs more than
they return, drafting goes off; every ``REPROBE`` steps a shape not taken lately is tried
again, so a change in the batch or the text is noticed.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

#: The prior on a row's per-token acceptance: ``PRIOR_RATE`` worth ``PRIOR_WEIGHT`` drafts.
PRIOR_RATE = 0.6
PRIOR_WEIGHT = 6.0
#: Timings kept per batch shape (their median is the shape's cost).
KEEP = 9
#: Steps between two tries of a width not measured lately.
REPROBE = 48


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a round of ``k`` drafts yields when each draft is kept with probability
    ``rate`` given the ones before it were: 1 + rate + rate^2 + ... + rate^k."""
    return sum(rate**i for i in range(k + 1))


class BatchDraftPolicy:
    """Draft widths for a batch (see the module docstring)."""

    def __init__(self) -> None:
        self._times: dict[tuple[int, int], collections.deque[float]] = {}
        self._last_tried: dict[tuple[int, int], int] = {}
        self._step = 0

    @staticmethod
    def rate(drafted: int, accepted: int) -> float:
        """A row's per-draft acceptance estimate."""
        return (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)

    def widths(self, caps: Sequence[int]) -> list[int]:
        """The candidate widths for rows allowed at most ``caps`` drafts each."""
        top = max(caps, default=0)
        return sorted({0, top, max(1, top // 2)}) if top else [0]

    def choose(self, caps: Sequence[int], rates: Sequence[float | None]) -> list[int]:
        """Each row's draft length: ``caps[b]`` is the most it may draft (0: it cannot),
        ``rates[b]`` its acceptance estimate (None: it has no drafter)."""
        self._step += 1
        rows = len(caps)
        candidates = self.widths(caps)
        if candidates == [0]:
            return [0] * rows
        stale = [w for w in candidates
                 if self._step - self._last_tried.get((rows, w), -REPROBE) >= REPROBE
                 and not self._known(rows, w)]
        if stale:  # unmeasured (or long untried) shapes are tried before they are judged
            width = stale[0]
        else:
            width = max(candidates, key=lambda w: self._throughput(rows, w, caps, rates))
            due = [w for w in candidates
                   if self._step - self._last_tried.get((rows, w), 0) >= REPROBE]
            if due and width not in due:
                width = due[0]
        self._last_tried[(rows, width)] = self._step
        return [min(width, cap) if rate is not None else 0 for cap, rate in zip(caps, rates)]

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step over ``rows`` rows whose widest draft was ``width`` took ``seconds``."""
        times = self._times.setdefault((rows, width), collections.deque(maxlen=KEEP))
        times.append(seconds)

    def cost(self, rows: int, width: int) -> float | None:
        times = self._times.get((rows, width))
        if not times:
            return None
        ordered = sorted(times)
        return ordered[len(ordered) // 2]

    def _known(self, rows: int, width: int) -> bool:
        return bool(self._times.get((rows, width)))

    def _throughput(self, rows: int, width: int, caps: Sequence[int],
                    rates: Sequence[float | None]) -> float:
        cost = self.cost(rows, width)
        if cost is None or cost <= 0:
            return 0.0
        tokens = sum(expected_tokens(rate, min(width, cap)) if rate is not None else 1.0
                     for cap, rate in zip(caps, rates))
        return tokens / cost
