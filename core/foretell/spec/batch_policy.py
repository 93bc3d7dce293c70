"""How far a batch's rows draft each step: acceptance learned per row, cost per batch shape.

Each step the scheduler asks for every row's draft length. A row's acceptance rate is
estimated from its own rounds with a prior worth a few rounds (a few rejections at a
request's start do not condemn its drafter): what its drafter's earlier rows accepted,
decayed (:meth:`BatchDraftPolicy.learn`), so a new request starts from its drafter's record; a step's cost is measured per batch shape
``(rows, width)`` as the median of its recent timings (one noisy step moves nothing). The
width chosen maximizes the expected tokens the step produces per second, plain decoding
(width 0) included, so where a batch is large enough that verifying drafts costs more than
they return, drafting goes off; every ``REPROBE`` steps a shape not taken lately is tried
again, so a change in the batch or the text is noticed; a width whose looks keep losing is
looked at half as often each time (up to ``MAX_BACKOFF``), so over a long run the looks cost
little.

A drafted step right after plain steps is not timed: it also pays for switching back (a model
drafter catches up on every plain token since its last draft), which the steps after it do
not; so a probe from plain decoding drafts two steps and times the second, as the
single-request policy does. A row count never measured at some width borrows that width's
cost relative to plain decoding from the nearest row count that measured both, so rows
joining or leaving do not set off a round of probes.
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
#: What the best row's acceptance might yet be above its estimate, when judging whether a
#: width is worth measuring at all; a width that could not pay even then is re-measured
#: HOPELESS_SLOWER times less often.
HOPE = 0.15
HOPELESS_SLOWER = 4
#: A width looked at again and again without winning waits at most this many REPROBEs.
MAX_BACKOFF = 8
#: Weight a drafter's record keeps per new draft (a memory of about 200 drafts).
RECORD_DECAY = 0.995


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
        self._last_width = 0
        #: Per drafter kind, decayed (drafted, accepted) over all its rows.
        self._record: dict[str, list[float]] = {}
        #: Per shape, its looks in a row since it was last the choice on merit.
        self._losing: dict[tuple[int, int], int] = {}
        #: A shape whose switch-back step went untimed: it is drafted again, timed.
        self._again: tuple[int, int] | None = None

    def rate(self, drafted: int, accepted: int, kind: str | None = None) -> float:
        """A row's per-draft acceptance estimate, its prior the record of drafter ``kind``."""
        return (accepted + self.prior(kind) * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)

    def prior(self, kind: str | None) -> float:
        record = self._record.get(kind) if kind is not None else None
        if not record or record[0] <= 0:
            return PRIOR_RATE
        drafted, accepted = record
        return (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (drafted + PRIOR_WEIGHT)

    def learn(self, kind: str, drafted: int, accepted: int) -> None:
        """A row of drafter ``kind`` kept ``accepted`` of ``drafted`` drafts."""
        record = self._record.setdefault(kind, [0.0, 0.0])
        decay = RECORD_DECAY**drafted
        record[0] = record[0] * decay + drafted
        record[1] = record[1] * decay + accepted

    @staticmethod
    def widths(top: int) -> list[int]:
        """The candidate widths for drafters drafting at most ``top`` a round."""
        return sorted({0, top, max(1, top // 2)}) if top else [0]

    def choose(self, caps: Sequence[int], rates: Sequence[float | None],
               top: int | None = None) -> list[int]:
        """Each row's draft length: ``caps[b]`` is the most it may draft now (0: it cannot),
        ``rates[b]`` its acceptance estimate (None: it has no drafter), ``top`` the most its
        drafters draft a round (default: the largest cap). Widths come from ``top``, each
        row's length capped, so rows nearing their ends (smaller caps) bring no new widths
        to measure."""
        self._step += 1
        rows = len(caps)
        if not max(caps, default=0):
            return [0] * rows
        candidates = self.widths(top if top is not None else max(caps))
        again, self._again = self._again, None
        if again is not None and again[0] == rows and again[1] in candidates:
            return [min(again[1], cap) if rate is not None else 0
                    for cap, rate in zip(caps, rates)]
        for w in candidates:  # a shape first met is as fresh as what its cost borrows from
            self._last_tried.setdefault((rows, w), self._step)
        # Unmeasured widths are tried before they are judged, narrowest first; none wider
        # than one that could not pay even at the best row's hopes.
        hope = min(1.0, max((r for r in rates if r is not None), default=0.0) + HOPE)
        blocked = {w for w in candidates
                   if any(self._hopeless(rows, v, hope) for v in range(1, w))}
        stale = [w for w in candidates if self.cost(rows, w) is None and w not in blocked]
        if stale:
            width = stale[0]
        else:
            width = max(candidates, key=lambda w: self._throughput(rows, w, caps, rates))
            self._losing[(rows, width)] = 0  # chosen on merit: looked at as often as ever
            due = [w for w in candidates if w not in blocked
                   and self._step - self._last_tried.get((rows, w), 0) >= self._interval(
                       rows, w, self._hopeless(rows, w, hope))]
            if due and width not in due:
                width = due[0]
                self._losing[(rows, width)] = self._losing.get((rows, width), 0) + 1
        self._last_tried[(rows, width)] = self._step
        return [min(width, cap) if rate is not None else 0 for cap, rate in zip(caps, rates)]

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step over ``rows`` rows whose widest draft was ``width`` took ``seconds``."""
        switching = width > 0 and self._last_width == 0
        self._last_width = width
        if switching:
            self._again = (rows, width)
            return
        times = self._times.setdefault((rows, width), collections.deque(maxlen=KEEP))
        times.append(seconds)

    def cost(self, rows: int, width: int) -> float | None:
        """The step's time over ``rows`` rows at ``width``: measured, else borrowed (the
        module docstring), else None."""
        measured = self._measured(rows, width)
        if measured is not None or width == 0:
            return measured
        plain = self._measured(rows, 0)
        if plain is None:
            return None
        near = [r for (r, w) in self._times if w == width and self._measured(r, 0)]
        if not near:
            return None
        r = min(near, key=lambda r: (abs(r - rows), r))
        return plain * self._measured(r, width) / self._measured(r, 0)

    def _interval(self, rows: int, width: int, hopeless: bool) -> int:
        """Steps between looks at a width not chosen: REPROBE, doubled for each look in a
        row that did not make it the choice (up to MAX_BACKOFF times), HOPELESS_SLOWER
        times more where it could not pay at all."""
        backoff = min(2 ** self._losing.get((rows, width), 0), MAX_BACKOFF)
        return REPROBE * backoff * (HOPELESS_SLOWER if hopeless else 1)

    def _hopeless(self, rows: int, width: int, rate: float) -> bool:
        """Drafting ``width`` over ``rows`` rows costs more than it returns even were each
        draft kept with probability ``rate``."""
        cost, plain = self.cost(rows, width), self.cost(rows, 0)
        return bool(width and cost and plain
                    and cost >= expected_tokens(rate, width) * plain)

    def _measured(self, rows: int, width: int) -> float | None:
        times = self._times.get((rows, width))
        if not times:
            return None
        ordered = sorted(times)
        return ordered[len(ordered) // 2]

    def _throughput(self, rows: int, width: int, caps: Sequence[int],
                    rates: Sequence[float | None]) -> float:
        cost = self.cost(rows, width)
        if cost is None or cost <= 0:
            return 0.0
        tokens = sum(expected_tokens(rate, min(width, cap)) if rate is not None else 1.0
                     for cap, rate in zip(caps, rates))
        return tokens / cost
