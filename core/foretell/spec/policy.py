"""How many tokens to draft each round, from what this machine and this drafter measure.

A round that drafts ``k`` tokens costs ``T(k)`` seconds and yields ``E(k) = 1 + sum over
j <= k of prod over i <= j of a_i`` tokens, where ``a_i`` is the measured chance that
draft position ``i`` is accepted once every earlier one was. The policy picks the ``k`` in
``0..max_k`` with the best ``E(k) / T(k)``; ``k = 0`` is a plain decoding step, so a drafter
that does not pay is switched off rather than slowing the request down.

``T(0)`` is the typical time of the recent plain steps (:func:`typical`); ``T(k)`` for
``k >= 1`` a robust line (Theil-Sen) through the typical recent round time of each draft
length seen (n = tokens actually drafted), so the model tracks what the machine does now
(a GPU where verifying 8 tokens costs little more than 1, a CPU where drafting costs the
draft model's compute). The first round of each length is not timed (it compiles that
shape's kernels on CUDA), nor a round the verifier flags as having paid a one-off cost (a
fixed-shape forward traced for a new window length or cache capacity,
:mod:`foretell.model.fixed`), and the typical time lets good rounds outvote a stall instead
of a stall switching a good length off. The first drafted rounds draft ``max_k``, then plain
stretches are timed; afterwards the policy probes now and then, alternately a neighbour of
the best ``k`` and the length timed longest ago among those that could still pay, so no
estimate goes stale for good (while drafting, a plain stretch once the plain-step estimate
is ``STALE_ROUNDS`` old), as often as a budget of about 1% of the decoding time allows
(``PROBE_BUDGET``): cheap probes often, costly ones rarely. A drafted round right after
plain steps is not timed, as it also pays for switching back (a model drafter catches up
on the plain tokens); so a probe from plain steps is two rounds, the second one timed. The
other way round, the verifier never times a plain run's first step (nor the lone step taken
when a drafter had nothing): it starts with nothing queued ahead of it (measured, each
stretch's first step on the 2-core Xeon: 1.8 plain steps; on the H200 the policy's
plain-step estimate read 2.03 ms against plain decoding's 1.12, and sampled MTP drafted on
at 0.80x plain).

Drafting that went off comes back once it pays (a drafter may disagree at the start of a
continuation and agree later: MTP on the demo's code prompt accepted ~1 of 6 drafts over
the first 20 tokens, ~4.5 after): a probe from plain steps drafts the most it may, so it
hears of every position; the evidence from before the plain steps weighs less the longer
they ran (never under ``AGED_ROUNDS`` rounds, so a drafter that never agrees stays judged
by that); and a probe that paid drafts on for ``TRIAL_ROUNDS`` rounds before the policy
chooses again.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence

#: Weight kept by old acceptance observations per new one (a memory of about 50 rounds).
DECAY = 0.98
#: Round times kept per draft length; its estimate is :func:`typical` of them, so a stall
#: (a kernel compiled on first use by a shape the drafter builds, a busy host) is outvoted
#: (measured on the H200: one 61 ms round kept an MTP length, really ~2 ms, switched off
#: under a running mean); a lasting slow-down shows within TIME_SAMPLES rounds.
TIME_SAMPLES = 5
#: Weight kept by the acceptance observations per plain stretch while drafting is off (as
#: many tokens as about four drafted rounds produce).
STRETCH_DECAY = DECAY**4
#: Rounds drafted at full length after a probe from plain steps that paid, before the
#: policy chooses again: two rounds cannot outvote the evidence that switched drafting off.
TRIAL_ROUNDS = 4
#: Aging never takes a position's evidence below this many rounds, so a drafter that never
#: agrees does not drift back to its prior and look worth probing again.
AGED_ROUNDS = 4.0
#: Strength of each draft position's prior, in rounds.
PRIOR_ROUNDS = 2.0
#: Every this many rounds, try a k other than the best one (see ``choose``).
PROBE_EVERY = 16
#: Plain decoding steps the verifier runs between two questions to the policy while drafting
#: is off (one "round" of the policy's count).
PLAIN_STRETCH = 8
#: While plain steps are best, probes may cost about this share of the decoding time: a
#: probe round that lost ``L`` plain steps' worth of time against plain decoding (its time
#: minus its tokens at a plain step's cost) waits ``L / (PROBE_BUDGET * PLAIN_STRETCH)``
#: rounds before the next probe, within [PROBE_EVERY_MIN, PROBE_EVERY_MAX]; one that would
#: have paid brings the next back after PROBE_EVERY. So a cheap probe (prompt lookup, whose
#: failed round costs a longer verify: 0.6 of a plain step on the CPU, 0.7 on the H200) is
#: repeated every few stretches and catches a drafter that starts paying mid-request, while
#: a costly one (a model drafter catching up on every plain token since its last draft: the
#: 6-layer self-draft probed every 16 stretches decoded at 0.92x plain on the CPU) backs off
#: to one per PROBE_EVERY_MAX rounds (512 tokens).
PROBE_BUDGET = 0.01
PROBE_EVERY_MIN = 4
PROBE_EVERY_MAX = 64
#: Drafted rounds timed before the first choice; the very first is a warm-up, not timed.
WARMUP_ROUNDS = 3
#: While drafting, every other probe times a plain stretch once the plain-step estimate is
#: this many rounds old: a host's speed drifts, and drafting weighed against a plain step
#: timed in a slow moment looked like a gain for good (2-core Xeon, 2026-12-03: the estimate
#: read 65.6 ms against plain decoding's ~37 ms, and self-drafting, which cannot pay on a
#: CPU, drafted at 0.75x plain). Starting the plain samples over at such a probe was tried
#: and dropped: the swinging-host simulation then drafted at a loss (0.93x on one seed).
STALE_ROUNDS = 128
#: Observations the policy keeps as it was told them (:attr:`DraftLengthPolicy.told`), for a
#: benchmark to show what its estimates came from: a request of 512 tokens, every one.
TOLD_KEPT = 512


class DraftLengthPolicy:
    def __init__(self, max_k: int, *, adaptive: bool = True):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.adaptive = adaptive
        # Observed (decayed) counts per draft position; priors are added in acceptance().
        self._offered = [0.0] * max_k
        self._accepted = [0.0] * max_k
        #: Estimated round time by tokens drafted (0: a plain step): the typical recent one.
        self._time: dict[int, float] = {}
        self._samples: dict[int, deque[float]] = {}
        #: Draft lengths whose first (untimed) round has run.
        self._seen: set[int] = set()
        #: The round each draft length was last timed in.
        self._timed_at: dict[int, int] = {}
        self._drafted_rounds = 0
        self._rounds = 0
        self._best = max_k
        self._probes = 0
        self._probe_every = PROBE_EVERY
        self._next_probe = PROBE_EVERY
        self._probing = False
        #: The last observation was a plain stretch (the next drafted round switches back).
        self._after_plain = False
        #: A probe's second round: the length its first, untimed round drafted.
        self._probe_again = 0
        #: Plain steps' worth of time a probe has lost so far.
        self._probe_lost = 0.0
        #: Plain stretches since the last drafted round.
        self._stretches_off = 0
        #: Rounds still to draft at full length after a probe that paid.
        self._trial = 0
        #: The newest TOLD_KEPT observations, oldest first: ``(drafted, accepted, seconds,
        #: use, at)``, ``use`` being how the time was used ("timed"; "untimed": a switch back
        #: or a one-off cost; "first": a length's first round) and ``at`` its
        #: ``time.perf_counter()``. Only read by benchmarks; it steers nothing.
        self.told: deque[tuple[int, int, float, str, float]] = deque(maxlen=TOLD_KEPT)

    # -- the model --------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """Per position, the chance a draft is kept once every earlier one was. Each
        position's prior is the position before it (2 rounds' worth; the first: 1/2), so a
        position rarely reached borrows from its neighbour instead of sitting at 1/2, which
        would keep a good drafter from ever trying longer drafts."""
        rates, prior = [], 0.5
        for accepted, offered in zip(self._accepted, self._offered):
            prior = (accepted + PRIOR_ROUNDS * prior) / (offered + PRIOR_ROUNDS)
            rates.append(prior)
        return rates

    def expected_tokens(self, k: int) -> float:
        return self._expected()[k]

    def _expected(self) -> list[float]:
        """``E(k)`` for every ``k`` in ``0..max_k``, in one pass over the acceptance."""
        totals, total, chain = [1.0], 1.0, 1.0
        for rate in self.acceptance():
            chain *= rate
            total += chain
            totals.append(total)
        return totals

    def measured(self) -> dict[int, float]:
        """Seconds per round as measured, by tokens drafted (0: a plain step): each
        length's :func:`typical` recent round, before any fit."""
        return dict(sorted(self._time.items()))

    def round_time(self, n: int) -> float | None:
        """Seconds of a round drafting ``n`` tokens, or None before a plain and a drafted
        round were timed (see :meth:`_round_times`)."""
        times = self._round_times()
        return times[n] if times is not None else None

    def _round_times(self) -> list[float] | None:
        """``T(k)`` for every ``k`` in ``0..max_k``, from one fit, or None before a plain
        and a drafted round were timed. A plain step (``k = 0``) is its own estimate; a
        drafted round is the Theil-Sen line through the drafted lengths' estimates (through
        the plain step and the one drafted length while only one is known), never below a
        plain step. Fitting the plain steps into the same line let one slow drafted round
        raise the plain estimate threefold on a busy CPU (measured), so self-drafting
        drafted on at a loss."""
        if 0 not in self._time or len(self._time) < 2:
            return None
        plain = self._time[0]
        drafted = {x: y for x, y in self._time.items() if x > 0}
        if len(drafted) == 1:
            ((x1, y1),) = drafted.items()
            slope, intercept = (y1 - plain) / x1, plain
        else:
            # Theil-Sen: the median of the pairwise slopes and of the intercepts they
            # leave, so one length whose only rounds stalled does not tilt the line.
            points = sorted(drafted.items())
            slope = max(statistics.median(
                (y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
                for x2, y2 in points[i + 1 :]), 0.0)
            intercept = statistics.median(y - slope * x for x, y in points)
        return [plain] + [max(intercept + slope * k, plain) for k in range(1, self.max_k + 1)]

    # -- the loop ---------------------------------------------------------------------

    def choose(self, limit: int) -> int:
        """Tokens to ask the drafter for this round, at most ``limit``."""
        self._rounds += 1
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        if not self.adaptive or self._drafted_rounds < WARMUP_ROUNDS:
            return limit
        if 0 not in self._time:
            return 0
        if self._probe_again:
            k, self._probe_again = self._probe_again, 0
            return min(k, limit)
        if self._trial:
            self._trial -= 1
            return limit
        times = self._round_times()
        if times is None:  # no drafted round timed yet (each was a length's first, say)
            return limit
        expected = self._expected()
        rates = [e / t for e, t in zip(expected, times)]
        self._best = max(range(self.max_k + 1), key=rates.__getitem__)
        k = self._best
        if self._rounds >= self._next_probe:
            self._next_probe = self._rounds + self._probe_every
            self._probes += 1
            if self._probes % 2:
                k = self._best - 1 if self._best == self.max_k else self._best + 1
                if self._best == 0:  # from plain steps: the most, to hear of every position
                    k = self.max_k
            elif self._best > 0 and self._rounds - self._timed_at.get(0, 0) > STALE_ROUNDS:
                k = 0  # a plain stretch: what drafting is weighed against, timed now
            else:
                k = self._stale_probe(rates, expected) or k
        self._probing = self._best == 0 and k > 0
        return min(k, limit)

    def _stale_probe(self, rates: list[float], expected: list[float]) -> int | None:
        """The length timed longest ago among those that would beat the best one by a
        quarter if their round cost no more than a plain step (a drafter that never agrees
        is not probed at lengths that cannot pay); None when there is none."""
        best, floor = max(rates), self._time[0]
        hopeful = [n for n in range(1, self.max_k + 1) if expected[n] / floor > 1.25 * best]
        return min(hopeful, key=lambda n: self._timed_at.get(n, -1)) if hopeful else None

    def observe(self, drafted: int, accepted: int, seconds: float, *,
                one_off: bool = False) -> None:
        """A round drafted ``drafted`` tokens, the target kept ``accepted``, in ``seconds``;
        ``one_off``: it paid a one-off cost besides (a graph traced for a new shape, say), so
        its time says nothing of what the length costs, and a probe runs another round.

        A drafted round right after plain steps is not timed: it also pays for switching
        back (a model drafter catches up on every plain token since its last draft, the
        pipeline refills), which the rounds after it do not. So a probe from plain steps
        runs two rounds, the second timed, and a drafter whose switch-back is costly is
        still judged by what its rounds cost while it drafts; the probe budget counts what
        both rounds lost."""
        switching = bool(drafted) and self._after_plain
        self._after_plain = not drafted
        untimed = switching or (one_off and bool(drafted))
        if self._probing:
            plain = self._time.get(0)
            if drafted and plain and not one_off:
                self._probe_lost += (seconds - (1 + accepted) * plain) / plain
            if untimed:
                self._probe_again = drafted
            else:
                self._probing = False
                lost, self._probe_lost = self._probe_lost, 0.0
                paid = seconds <= (1 + accepted) * plain if plain else False
                if paid:  # a probe that paid drafts on a while: its evidence outweighs the past
                    self._trial = TRIAL_ROUNDS
                if lost > 0:
                    wait = math.ceil(lost / (PROBE_BUDGET * PLAIN_STRETCH))
                    self._probe_every = min(max(wait, PROBE_EVERY_MIN), PROBE_EVERY_MAX)
                else:
                    self._probe_every = PROBE_EVERY
        if not drafted:
            self._stretches_off += 1
        elif self._stretches_off:  # the text moved on while drafting was off: what was
            # seen before weighs less than now, though never less than AGED_ROUNDS rounds
            fade = STRETCH_DECAY**self._stretches_off
            for i, offered in enumerate(self._offered):
                scale = max(fade, min(1.0, AGED_ROUNDS / offered)) if offered else 1.0
                self._offered[i] *= scale
                self._accepted[i] *= scale
            self._stretches_off = 0
        for i in range(drafted):
            self._offered[i] = self._offered[i] * DECAY + 1.0
            self._accepted[i] = self._accepted[i] * DECAY + (1.0 if i < accepted else 0.0)
            if i >= accepted:
                break
        if drafted:
            self._drafted_rounds += 1
        if untimed:
            self._seen.add(drafted)  # it paid this length's first-use costs too
            self.told.append((drafted, accepted, seconds, "untimed", time.perf_counter()))
            return
        if drafted not in self._seen:
            # A length's first round pays its one-off costs: on CUDA, MLX compiles the
            # kernels of each new window shape on first use (seconds, measured on the H200),
            # which once kept a drafter at 88% acceptance drafting under one token a round.
            self._seen.add(drafted)
            self.told.append((drafted, accepted, seconds, "first", time.perf_counter()))
            return
        self.told.append((drafted, accepted, seconds, "timed", time.perf_counter()))
        self._timed_at[drafted] = self._rounds
        recent = self._samples.setdefault(drafted, deque(maxlen=TIME_SAMPLES))
        recent.append(seconds)
        self._time[drafted] = typical(recent)


def typical(recent: Sequence[float]) -> float:
    """What a round of one length costs, from its recent times: their median, the least of
    them while there are fewer than three (one good round outvotes a stall either way).

    Not the least of all of them: a plain step's times are each the mean of a stretch of
    :data:`PLAIN_STRETCH` steps, a drafted length's each one round, so on a host whose speed
    swings the least drafted round is the luckier draw, and drafting that merely breaks even
    looks like a gain. Simulated (``tests/spec/test_policy.py``, a target drafting for
    itself at 95% acceptance, every time swinging ±30%): the least of five drafted at a loss,
    0.91-0.99x plain over eight seeds; the median 0.97-0.99x. On the 2-core Xeon, busy,
    the ``self`` row had run 0.79x and 0.89x plain paired (docs/benchmarks.md)."""
    return min(recent) if len(recent) < 3 else statistics.median(recent)
