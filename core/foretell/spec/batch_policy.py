"""How far a batch's rows draft each step: acceptance learned per row, cost per batch shape.

Each step the scheduler asks for every row's draft length. A row's acceptance rate is the
chance that a draft is kept given the drafts before it were (what :func:`expected_tokens`
reads), estimated from its own recent rounds: a round that kept ``a`` of ``k`` drafts tried
``a + 1`` positions and kept ``a`` of them (``a`` of ``a`` where it kept all), since the
verifier stops at the first rejection. (Counting ``a`` of ``k`` instead reads a row keeping
1.27 of 2 drafts as 0.64 where it is 0.73, and the step's tokens 10% short.) The estimate is
decayed (acceptance moves within a request, the start of a continuation being the hardest to
guess), with a prior worth a few positions: what its drafter's earlier rows kept, decayed
(:meth:`BatchDraftPolicy.learn`), so a new request starts from its drafter's record. A
step's cost is measured per batch shape ``(rows, width)`` as the lower quartile of its
recent timings: another process on the host only ever adds time, so that tracks what the
step itself costs, one noisy step moves nothing, and shapes timed at busy and at quiet
moments compare fairly. The width chosen maximizes the expected tokens the step produces per
second, plain decoding (width 0) included, so where a batch is large enough that verifying
drafts costs more than they return, drafting goes off; drafting must beat plain decoding by
``CLEAR_GAIN``, for what the per-step estimate leaves out: switching back and forth, and
costs timed at different moments of a host whose speed drifts. Drafting once chosen goes on
while it promises ``HOLD_GAIN``: its own rounds keep its rows' estimates current, where a
batch that stopped drafting learns nothing more of its rows until a look (a row's estimate,
remembering a dozen positions, dips below the bar on a few rejections in a row, and at 64
tokens a request no look came before it ended).

A batch that will not be refilled (no request waiting) ends with its slowest row: drafted
rows keep their drafts unevenly, so they drift apart, and the batch's last steps run over
its slowest rows at nearly a full step's cost, where plain rows all end at one step. Told
each row's tokens left (``draining``), a width's throughput is divided by the steps that
drift adds: the rows' tokens a step vary (a kept-draft count is a truncated geometric), so
after ``R`` tokens at ``mu`` a step with variance ``var`` the slowest of ``B`` rows is
``k_B * sqrt(R * var / mu**3)`` steps behind the mean (``k_B`` the expected largest of
``B`` standard normals), ``1 + k_B * sqrt(var / (mu * R))`` times the steps. (At B = 8,
64 tokens, width 2 drafted throughout, 9 of a batch's 32 steps ran over fewer rows: the
per-step estimate said 1.2x plain, the batch ran 1.1x.)

A shape not measured is estimated, not tried blind: a step's cost grows about linearly with
its width (the drafter runs once per draft, the target verifies one more token per row), so
a width costs plain decoding plus its share of the nearest width measured over as many rows;
a row count with no drafted width (or no plain step) measured borrows the nearest row
count's costs relative to plain decoding (so rows joining or leaving, as at the end of a
batch whose rows finish apart, set off no probes). An estimated width is measured when its
estimate is the best; only where no plain or no drafted step was ever measured is the
narrowest width tried blind. So a wide width that the narrow one's cost says cannot win is
not probed at a request's start: on a CPU each probe step at a large batch costs several
plain steps, and a batch of equal requests ends with its slowest row. Plain decoding timed
once over a row count is timed again before anything is weighed against it: on a GPU a
shape's first step may compile its kernels.

Widths not chosen are looked at again, so a change in the batch or the text is noticed, but
spaced so that what a look may lose stays under ``LOOK_SHARE`` of the steps between looks,
and never closer than ``REPROBE`` steps. What it loses is its two steps' time less the time
the chosen width would take to yield the tokens they are expected to (at the rows' mean
estimate): a width that promises nearly what the choice does loses next to nothing and is
looked at every ``REPROBE`` steps, and those looks are what bring rows whose estimates sit
just under the bar back to drafting (counting a look's whole extra time, rows of the EPYC at
B = 2 sat plain for whole 64-token requests at a record of 0.63-0.66 where they kept 82%).
A width whose looks keep losing is looked at half as often each time (up to
``MAX_BACKOFF``), one that could not pay even at the best row's hopes ``HOPELESS_SLOWER``
times less, and none wider than one that could not pay. A look over rows whose drafters
were never fed (a row's drafter hears its sequence only when the row first drafts) also
pays for feeding them, which the caller times (:meth:`BatchDraftPolicy.woke`): that counts
among what the look loses, so looks over rows that joined while the batch decoded plainly
come as much less often as feeding them costs (on an H100 at B = 16, looks each feeding 16
rows' drafters ran the batch at 0.8x plain decoding). A plain choice over the same rows and
estimates stands ``PLAIN_HOLD`` steps (never past a look's due step) without being worked
out again: on a host-bound GPU step working it out cost ~5%.

A step right after a change of kind is not timed: a drafted step after plain ones also pays
for switching back (a model drafter catches up on every plain token since its last draft),
and the caller reports a step it could not time fairly (``observe(..., None)``, e.g. the
first pipelined plain step, which waits for no earlier step); either way the same width is
chosen once more and that step is timed, as the single-request policy does. So a batch of
fresh rows decodes its first three steps plainly (the step that draws the rows' first tokens,
then one that waits for nothing, then that one timed): drafting from the second step instead
ran 3-5% slower at B = 4 on the EPYC, as a request's first positions keep fewer drafts than
its drafter's record says, and fresh rows' estimates start from that record.
"""

from __future__ import annotations

import collections
import functools
import math
import statistics
from collections.abc import Callable, Hashable, Iterable, Sequence

#: The prior on a row's per-position acceptance: ``PRIOR_RATE`` worth ``PRIOR_WEIGHT`` positions.
PRIOR_RATE = 0.6
PRIOR_WEIGHT = 6.0
#: Timings kept per batch shape (their lower quartile is the shape's cost).
KEEP = 9
#: The fewest steps between two looks at a width not chosen.
REPROBE = 48
#: The most of the time between looks that a look's own steps may lose (rows drifting
#: apart after it lose about as much again at a batch's end).
LOOK_SHARE = 0.01
#: What the best row's acceptance might yet be above its estimate, when judging whether a
#: width is worth looking at at all; a width that could not pay even then is looked at
#: HOPELESS_SLOWER times less often.
HOPE = 0.15
HOPELESS_SLOWER = 4
#: A width looked at again and again without winning waits at most this many intervals.
MAX_BACKOFF = 8
#: Weight a drafter's record keeps per position tried (a memory of about 200).
RECORD_DECAY = 0.995
#: Weight a row's own evidence keeps per position tried (a memory of about 12).
ROW_DECAY = 0.92
#: How much more throughput drafting must promise than plain decoding to be chosen (a CPU
#: case where the per-step estimate said ~1.1x and the batch ran 1.0x: docs/decisions.md,
#: "The batch policy at B = 4-8").
CLEAR_GAIN = 0.2
#: How much more drafting, once chosen, must go on promising to stay chosen.
HOLD_GAIN = 0.05
#: Steps a plain choice stands for the same rows and estimates without being worked out
#: again (never past a look's due step): idle drafter rows' choice cost a host-bound GPU
#: step ~5% (B = 4 on the H100: 0.97 ms a step against plain rows' 0.92), and at 4 steps
#: still 2-3% of a B = 32 step (docs/decisions.md, "MTP rows that never draft").
PLAIN_HOLD = 16


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a round of ``k`` drafts yields when each draft is kept with probability
    ``rate`` given the ones before it were: 1 + rate + rate^2 + ... + rate^k."""
    return sum(rate**i for i in range(k + 1))


def batch_tokens(rows: int, drafting: int, rate: float, width: int) -> float:
    """Tokens a step over ``rows`` rows yields when ``drafting`` of them draft ``width``,
    each keeping drafts at ``rate``, and the rest take a plain step."""
    return rows + drafting * (expected_tokens(rate, width) - 1.0)


def tokens_variance(rate: float, k: int) -> float:
    """The variance of that round's tokens: the kept count ``A`` has ``P(A >= i) = rate^i``
    (``i <= k``), so ``E[A^2] = sum (2i - 1) rate^i``."""
    mean = expected_tokens(rate, k) - 1.0
    return sum((2 * i - 1) * rate**i for i in range(1, k + 1)) - mean * mean


@functools.cache  # a pure function of the row count, asked per width every drafting step
def slowest_of(rows: int) -> float:
    """The expected largest of ``rows`` standard normals (Blom's approximation; 0 for one)."""
    if rows < 2:
        return 0.0
    return statistics.NormalDist().inv_cdf((rows - 0.375) / (rows + 0.25))


def drift_factor(rounds: Sequence[tuple[float, float, int]]) -> float:
    """How many times the steps a draining batch takes (module docstring): its drafting
    rows' slowest behind their mean. ``rounds``: per drafting row, its expected tokens a
    step, their variance and the tokens it has left."""
    if len(rounds) < 2:
        return 1.0
    mu = statistics.fmean(m for m, _, _ in rounds)
    var = statistics.fmean(v for _, v, _ in rounds)
    tokens = statistics.fmean(max(1, n) for _, _, n in rounds)
    return 1.0 + slowest_of(len(rounds)) * math.sqrt(var / (mu * tokens))


class BatchDraftPolicy:
    """Draft widths for a batch (see the module docstring)."""

    def __init__(self) -> None:
        self._times: dict[tuple[int, int], collections.deque[float]] = {}
        self._last_tried: dict[tuple[int, int], int] = {}
        self._step = 0
        self._last_width = 0
        #: Per drafter kind, decayed (positions tried, kept) over all its rows.
        self._record: dict[str, list[float]] = {}
        #: Per shape, its looks in a row since it was last the choice on merit.
        self._losing: dict[tuple[int, int], int] = {}
        #: A shape whose last step went untimed: it is chosen once more, timed.
        self._again: tuple[int, int] | None = None
        #: Per row (a key the caller gives), decayed (positions tried, kept).
        self._rows: dict[Hashable, list[float]] = {}
        #: Changes whenever a row's acceptance estimate may have: a caller may keep the
        #: estimates it read while this stays (a batch of idle drafters learns nothing).
        self.version = 0
        #: Per shape, its cost while no timing came since (sorting them every step, for
        #: every shape an estimate reads, cost a batch step more than its rows' choice).
        self._quartiles: dict[tuple[int, int], float] = {}
        #: Whether the last choice on merit was a drafted width (HOLD_GAIN then holds).
        self._drafting = False
        #: A plain choice standing: (until step, (rows, top), the rates it was made on).
        self._plain_hold: tuple[int, tuple[int, int], tuple] | None = None
        #: The step at which the next look of the last choice is due.
        self._look_due = 0
        #: Seconds feeding one row's drafter its sequence adds to a step (decayed), and the
        #: rows the choice being made would have to feed (:meth:`woke`).
        self._wake_cost = 0.0
        self._dormant = 0

    def rate(self, tried: float, kept: float, kind: str | None = None) -> float:
        """A row's per-position acceptance estimate from ``kept`` of ``tried`` positions,
        its prior the record of drafter ``kind``."""
        return (kept + self.prior(kind) * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def prior(self, kind: str | None) -> float:
        record = self._record.get(kind) if kind is not None else None
        if not record or record[0] <= 0:
            return PRIOR_RATE
        tried, kept = record
        return (kept + PRIOR_RATE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def learn(self, kind: str, drafted: int, accepted: int, row: Hashable = None) -> None:
        """A row of drafter ``kind`` (``row``: its key, for :meth:`row_rate`) kept
        ``accepted`` of ``drafted`` drafts (0 drafted: its drafter found nothing, a
        position lost). Counted by positions tried (the module docstring)."""
        tried = accepted + (accepted < drafted or not drafted)
        _decayed_add(self._record.setdefault(kind, [0.0, 0.0]), RECORD_DECAY, tried, accepted)
        self.version += 1
        if row is not None:
            _decayed_add(self._rows.setdefault(row, [0.0, 0.0]), ROW_DECAY, tried, accepted)

    def row_rate(self, row: Hashable, kind: str | None = None) -> float:
        """Row ``row``'s acceptance estimate from its recent drafts (module docstring)."""
        tried, kept = self._rows.get(row, (0.0, 0.0))
        return self.rate(tried, kept, kind)

    def retain(self, rows: Iterable[Hashable]) -> None:
        """Forget the evidence of rows other than ``rows`` (they left the batch)."""
        keep = set(rows)
        if not self._rows.keys() <= keep:
            self._rows = {row: counts for row, counts in self._rows.items() if row in keep}
            self.version += 1

    @staticmethod
    def widths(top: int) -> list[int]:
        """The candidate widths for drafters drafting at most ``top`` a round."""
        return sorted({0, top, max(1, top // 2)}) if top else [0]

    @property
    def drafting(self) -> bool:
        """Whether its last choice drafted (as if so before its first)."""
        return self._drafting or self._step == 0

    def choose(self, caps: Sequence[int] | Callable[[], Sequence[int]],
               rates: Sequence[float | None], top: int | None = None,
               draining: Sequence[int] | Callable[[], Sequence[int]] | None = None,
               dormant: int = 0) -> list[int]:
        """Each row's draft length: ``caps[b]`` is the most it may draft now (0: it cannot),
        ``rates[b]`` its acceptance estimate (None: it has no drafter), ``top`` the most its
        drafters draft a round (default: the largest cap), ``draining`` each row's tokens
        left where no request waits to take a finished row's place (None: rows are
        replaced as they end; the module docstring). Widths come from ``top``, each row's
        length capped, so rows nearing their ends (smaller caps) bring no new widths to
        measure. ``caps`` and ``draining`` may be functions giving them, called only where
        the choice depends on them: a plain choice needs neither, and working them out row
        by row cost a large batch's step more than the choice itself. ``dormant``: rows
        whose drafters a drafted step would first feed their sequences (:meth:`woke`)."""
        self._step += 1
        self._dormant = dormant
        rows = len(rates)
        hold, self._plain_hold = self._plain_hold, None
        if hold is not None and self._again is None and self._step < hold[0] \
                and hold[1] == (rows, top) and hold[2] == tuple(rates):
            self._plain_hold = hold
            self._last_tried[(rows, 0)] = self._step
            return [0] * rows
        given = None if callable(caps) else caps

        def row_caps() -> Sequence[int]:
            nonlocal given
            if given is None:
                given = caps()
            return given

        if top is None:
            top = max(row_caps(), default=0)
        if not top:
            return [0] * rows
        candidates = self.widths(top)
        again, self._again = self._again, None
        repeat = again is not None and again[0] == rows and again[1] in candidates
        if repeat:
            width = again[1]
        else:
            for w in candidates:  # a shape first met is as fresh as what its estimate rests on
                self._last_tried.setdefault((rows, w), self._step)
            width = self._blind(rows, candidates)
        if width is None:
            costs = {w: self.cost(rows, w) for w in candidates}  # once a step, for all
            known = [r for r in rates if r is not None]
            best = max(known, default=0.0)
            gain = HOLD_GAIN if self._drafting else CLEAR_GAIN
            if self._plain_unbeaten(costs, rows, rows - rates.count(None), best, gain):
                width = 0
            else:
                left = draining() if callable(draining) else draining
                value = {w: self._throughput(costs[w], w, row_caps(), rates, left)
                         for w in candidates}
                width = max(candidates, key=value.__getitem__)
                if width and value[width] < (1.0 + gain) * value[0]:
                    width = 0
            self._drafting = width > 0
            self._losing[(rows, width)] = 0  # chosen on merit: looked at as often as ever
            mean = sum(known) / len(known) if known else 0.0
            yields = {w: batch_tokens(rows, len(known), mean, w) for w in candidates}
            look = self._look(rows, candidates, width, best, costs, yields)
            if look is not None:
                width = look
                self._losing[(rows, width)] = self._losing.get((rows, width), 0) + 1
            elif not width and top is not None and (given is None or any(given)):
                # Not where no row could draft this step (a batch's first, before its rows'
                # first tokens): that choice says nothing of the steps after it.
                self._plain_hold = (min(self._step + PLAIN_HOLD, self._look_due),
                                    (rows, top), tuple(rates))
        if width and not max(row_caps(), default=0):
            return [0] * rows  # no row can draft now: nothing to try or time
        if not repeat:
            self._last_tried[(rows, width)] = self._step
        return _lengths(width, row_caps(), rates) if width else [0] * rows

    def observe(self, rows: int, width: int, seconds: float | None) -> None:
        """A step over ``rows`` rows whose widest draft was ``width`` took ``seconds``
        (None: the caller could not time it fairly)."""
        switching = width > 0 and self._last_width == 0
        self._last_width = width
        if switching or seconds is None:
            self._again = (rows, width)
            return
        times = self._times.setdefault((rows, width), collections.deque(maxlen=KEEP))
        times.append(seconds)
        self._quartiles.pop((rows, width), None)

    def woke(self, fed: int, rows: int, width: int, seconds: float) -> None:
        """A step over ``rows`` rows at ``width`` that first fed ``fed`` rows' drafters their
        sequences took ``seconds``: what it took beyond the shape's cost (plain decoding's
        where the width's is not known yet) is what feeding them cost (the module
        docstring)."""
        cost = self.cost(rows, width) or self.cost(rows, 0)
        if fed > 0 and cost is not None:
            each = max(0.0, seconds - cost) / fed
            self._wake_cost = each if not self._wake_cost else 0.5 * (self._wake_cost + each)

    def cost(self, rows: int, width: int) -> float | None:
        """The step's time over ``rows`` rows at ``width``: measured, else estimated (the
        module docstring), else None."""
        measured = self._measured(rows, width)
        if measured is not None:
            return measured
        plain = self._measured(rows, 0)
        if plain is None:
            # Plain decoding over the nearest row count: every width's estimate here is
            # relative to it, so choices rest on the relative costs alone.
            near = [r for (r, w) in self._times if not w]
            if not near:
                return None
            plain = self._measured(min(near, key=lambda r: (abs(r - rows), r)), 0)
        if width == 0:
            return plain
        slope = self._slope(rows, width)
        return None if slope is None else plain * (1.0 + slope * width)

    def _slope(self, rows: int, width: int) -> float | None:
        """A draft's cost relative to a plain step over ``rows`` rows: from the width
        nearest ``width`` measured over the nearest row count that measured one and plain
        decoding too."""
        measured = [(r, w) for (r, w) in self._times if w and self._measured(r, 0)]
        if not measured:
            return None
        r, w = min(measured, key=lambda s: (abs(s[0] - rows), s[0], abs(s[1] - width), s[1]))
        return (self._measured(r, w) / self._measured(r, 0) - 1.0) / w

    def _blind(self, rows: int, candidates: list[int]) -> int | None:
        """The width to measure because nothing can be estimated without it: plain
        decoding, where it was never measured or only once over these rows (a shape's first
        step on a GPU may compile its kernels: one plain step over 4 rows timed 6.4 ms where
        the next took 0.9, and drafting at 5 ms a step ran on against it), then, where no
        drafted step was ever measured, the narrowest drafted width."""
        if self.cost(rows, 0) is None or len(self._times.get((rows, 0), ())) == 1:
            return 0
        drafted = [w for w in candidates if w]
        if drafted and self.cost(rows, drafted[0]) is None:
            return drafted[0]
        return None

    def _look(self, rows: int, candidates: list[int], chosen: int, best: float,
              costs: dict[int, float | None], yields: dict[int, float]) -> int | None:
        """The narrowest width not chosen whose next look is due, if any (``best``: the
        best row's acceptance estimate; ``costs``: each candidate's, this step's;
        ``yields``: the tokens a step of each yields at the rows' mean estimate)."""
        hope = min(1.0, best + HOPE)
        hopeless = {w: self._hopeless(w, hope, costs) for w in candidates}
        self._look_due = self._step + REPROBE
        for w in candidates:
            if w == chosen or any(hopeless[v] for v in candidates if 0 < v < w):
                continue
            due = self._last_tried[(rows, w)] + self._interval(rows, w, chosen, hopeless[w],
                                                                costs, yields)
            if self._step >= due:
                return w
            self._look_due = min(self._look_due, math.ceil(due))
        return None

    def _interval(self, rows: int, width: int, chosen: int, hopeless: bool,
                  costs: dict[int, float | None], yields: dict[int, float]) -> float:
        """Steps between looks at ``width`` while ``chosen`` is the choice: long enough
        that a look's two steps lose at most LOOK_SHARE of them, at least REPROBE; for a
        drafted width that span doubled for each look in a row that did not make it the
        choice (up to MAX_BACKOFF times), HOPELESS_SLOWER times longer where it could not
        pay at all.

        What a look loses is its steps' time less the time the choice takes to yield the
        tokens they are expected to (``yields``), so a width promising nearly what the
        choice does is looked at every REPROBE steps: its looks cost little, and they are
        what brings rows whose estimates sit just under the bar back to drafting. Plain
        decoding is looked at every REPROBE steps: every choice weighs against it, and a
        host's speed drifts."""
        cost, base = costs[width], costs[chosen]
        steps = float(REPROBE)
        if width and cost is not None and base:
            worth = yields[width] / cost / (yields[chosen] / base)  # the choice's rate: 1
            lost = 2.0 * cost * max(0.0, 1.0 - worth) + self._wake_cost * self._dormant
            backoff = min(2 ** self._losing.get((rows, width), 0), MAX_BACKOFF)
            steps = max(steps, backoff * lost / (LOOK_SHARE * base))
        return steps * (HOPELESS_SLOWER if hopeless else 1)

    @staticmethod
    def _hopeless(width: int, rate: float, costs: dict[int, float | None]) -> bool:
        """Drafting ``width`` (at this step's ``costs``) costs more than it returns even
        were each draft kept with probability ``rate``."""
        cost, plain = costs[width], costs[0]
        return bool(width and cost and plain
                    and cost >= expected_tokens(rate, width) * plain)

    def _measured(self, rows: int, width: int) -> float | None:
        shape = (rows, width)
        quartile = self._quartiles.get(shape)
        if quartile is None:
            times = self._times.get(shape)
            if not times:
                return None
            quartile = self._quartiles[shape] = sorted(times)[len(times) // 4]
        return quartile

    @staticmethod
    def _plain_unbeaten(costs: dict[int, float | None], rows: int, drafting: int,
                        best: float, gain: float) -> bool:
        """Whether plain decoding wins even were every drafting row to keep drafts as well
        as the best row does (each row's expected tokens grow with its rate and length):
        then the choice is plain decoding without a sum over the rows per width, so a
        batch of idle drafters keeps deciding so at little more than a plain batch's cost
        (the choice is the one :meth:`_throughput`'s comparison makes)."""
        plain = costs.get(0)
        if plain is None or plain <= 0:
            return False
        bar = (1.0 + gain) * rows / plain  # plain decoding's value, cleared
        for width, cost in costs.items():
            if width and cost is not None and cost > 0 and \
                    batch_tokens(rows, drafting, best, width) / cost >= bar:
                return False
        return True

    @staticmethod
    def _throughput(cost: float | None, width: int, caps: Sequence[int],
                    rates: Sequence[float | None], left: Sequence[int] | None = None) -> float:
        """Tokens a second at ``width``: the rows' expected tokens a step over the step's
        cost and, for a draining batch (``left``: each row's tokens left), over the steps
        its rows' drift adds (:func:`drift_factor`)."""
        if cost is None or cost <= 0:
            return 0.0
        tokens, rounds = 0.0, []
        for b, (cap, rate) in enumerate(zip(caps, rates)):
            k = min(width, cap) if rate is not None else 0
            mu = expected_tokens(rate, k) if k else 1.0
            tokens += mu
            if k and left is not None:
                rounds.append((mu, tokens_variance(rate, k), left[b]))
        return tokens / cost / drift_factor(rounds)


def _lengths(width: int, caps: Sequence[int], rates: Sequence[float | None]) -> list[int]:
    """Each row's draft length at ``width``: capped by the row, 0 for rows without a drafter."""
    return [min(width, cap) if rate is not None else 0 for cap, rate in zip(caps, rates)]


def _decayed_add(counts: list[float], decay: float, tried: int, kept: int) -> None:
    """Add a round to decayed ``[tried, kept]`` counts, older rounds fading by ``decay`` per
    position tried."""
    fade = decay**tried
    counts[0] = counts[0] * fade + tried
    counts[1] = counts[1] * fade + kept
