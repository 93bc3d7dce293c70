"""How many tokens to draft each round, from what this machine and this drafter measure.

A round drafting ``k`` tokens costs ``T(k)`` and yields ``E(k) = 1 + sum_j prod_{i<=j} a_i``
tokens (``a_i``: the measured chance that draft position ``i`` is accepted once the earlier
ones were); the policy drafts the ``k`` in ``0..max_k`` with the best ``E(k) / T(k)``, and
``k = 0`` is a plain step, so a drafter that does not pay is switched off. Costs are robust
estimates of recent times (no decision rests on one time); acceptance is decayed counts
with a prior, judged optimistically while evidence is thin and probed again from a budget
that grows with the tokens; a state recalled from another process (:meth:`state`,
:meth:`recall`, :mod:`foretell.spec.memory`) is a prior that fades. Each rule and the case
that made it: docs/speculation.md, "Draft length"; figures: docs/decisions.md.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence

from foretell.spec.cost_prior import cannot_pay
from foretell.spec.policy_state import STATE_FORMAT, STATE_TIMINGS, checked_state

#: Weight kept by old acceptance observations per new drafted round (a memory of about 50).
DECAY = 0.98
#: Round times kept per draft length; its estimate is :func:`typical` of them, so a stall (a
#: kernel compiled on first use, a busy host) is outvoted (one 61 ms round kept an MTP length,
#: really ~2 ms, switched off under a running mean); a lasting slow-down shows within them.
TIME_SAMPLES = 5
#: Fading never takes a position's evidence below this many rounds. A drafter that never
#: agrees drifts back towards its prior: how often it is probed again is the budget's to say.
AGED_ROUNDS = 1.0
#: Strength of each draft position's prior, in rounds.
PRIOR_ROUNDS = 2.0
#: Standard errors above the mean acceptance that the optimistic bound lies: with the
#: warm-up's three rounds all rejected, position 0's bound is still ~0.5.
OPTIMISM = 1.5
#: Standard errors above the mean acceptance at which the length to draft is chosen, once
#: drafting pays: longer drafts reach positions whose evidence is thin.
LENGTH_OPTIMISM = 1.0
#: The most exploring may cost: this share of the tokens seen, in plain steps lost against
#: plain decoding ...
EXPLORE_SHARE = 0.02
#: ... plus this many plain steps.
EXPLORE_ALLOWANCE = 1.0
#: A round counts against the budget at most this many times its length's estimated time
#: (a stall, a busy host), so one slow round cannot block exploring for a whole run.
LOSS_CAP = 2.0
#: Rounds a probe from plain steps drafts on after a timed round that paid by itself.
TRIAL_ROUNDS = 3
#: While drafting, every this many rounds, try a k other than the best one (see ``choose``).
PROBE_EVERY = 16
#: Plain decoding steps the verifier runs between two questions to the policy while drafting
#: is off (one "round" of the policy's count).
PLAIN_STRETCH = 8
#: Weight kept by the acceptance evidence per plain stretch (what as many drafted rounds
#: keep), so a switched-off drafter's evidence fades as the text moves on and the optimistic
#: bound widens: how often it is probed again is then the budget's to say.
STRETCH_DECAY = DECAY**PLAIN_STRETCH
#: The stretch that times plain steps while drafting (the first time, and when the estimate
#: is stale); its first step is never timed. A fresh policy times plain steps twice early on
#: (the first may meet a slow moment): a short request pays for each (decisions.md, item 16).
TIMING_STRETCH = 2
#: Drafted rounds (at the most tokens) before the first choice; the first is not timed. The
#: price of trying a drafter, outside the exploring budget unless none kept a draft (then it
#: was exploring that found nothing), and skipped where the drafter's declared cost says no
#: length can pay (:mod:`foretell.spec.cost_prior`). A recalled state skips it, but its first
#: this many rounds are accounted as a warm-up's: left outside the budget whatever they kept,
#: they let a never-agreeing drafter spend the whole budget after them.
WARMUP_ROUNDS = 3
#: Standard errors of the times by which drafting must beat plain steps to be chosen ...
CONFIDENCE = 1.0
#: ... taking a length timed fewer than three times to be this uncertain (relative).
THIN_SPREAD = 0.05
#: Once drafting has lost more than the exploring budget, a length is drafted only if it
#: beats plain steps by this share on the mean estimates (they were wrong somewhere).
CLEAR_GAIN = 0.1
#: While drafting, plain steps are timed again once their estimate is this many rounds old:
#: against one timed in a slow moment, a drafter that cannot pay looked like a gain for good.
#: That fresh time stands alone (older plain times are dropped): the median would keep them.
STALE_ROUNDS = 128
#: A length whose time rests on rounds of one moment is timed again before it switches
#: drafting off if its rounds would yield this many tokens on the mean acceptance.
UNCONFIRMED = 1.5
#: A recalled state's acceptance counts weigh at most this many rounds at any position:
#: what a warm-up would have taught, so the request's own rounds outvote it within a few.
RECALLED_ROUNDS = 3.0
#: What a recalled state's acceptance counts keep of their weight at a position each time
#: this request drafts to it (a round that keeps nothing fades them more: ``_learn``).
RECALL_FADE = 0.8
#: A recalled state's costs are checked by timing plain steps once this process's drafted
#: rounds imply a plain step this many times dearer or cheaper than the state's.
PLAIN_DRIFT = 1.5
#: Observations kept as told (:attr:`DraftLengthPolicy.told`), for benchmarks: 512 tokens' worth.
TOLD_KEPT = 512


class DraftLengthPolicy:
    def __init__(self, max_k: int, *, adaptive: bool = True, draft_cost: float | None = None):
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        self.max_k = max_k
        self.adaptive = adaptive
        self.draft_cost = draft_cost  # a drafted token's cost in plain steps, declared, or None
        self._warmup_rounds = 0 if cannot_pay(draft_cost) else WARMUP_ROUNDS
        # Observed (decayed) counts per draft position; priors are added in acceptance().
        self._offered = [0.0] * max_k
        self._accepted = [0.0] * max_k
        #: A recalled state's counts per position, apart: each round this request drafts
        #: to a position fades them by RECALL_FADE, so the request's own rounds take over.
        self._prior_offered = [0.0] * max_k
        self._prior_accepted = [0.0] * max_k
        #: Estimated round time by tokens drafted (0: a plain step): the typical recent one.
        self._time: dict[int, float] = {}
        self._samples: dict[int, deque[float]] = {}
        #: Draft lengths whose first (untimed) round has run.
        self._seen: set[int] = set()
        #: The round each draft length was last timed in.
        self._timed_at: dict[int, int] = {}
        self._drafted_rounds = 0
        self._rounds = 0
        self._probes = 0
        self._next_probe = PROBE_EVERY
        #: The last observation was a plain stretch (the next drafted round switches back).
        self._after_plain = False
        #: A probe's second round: the length its first, untimed round drafted.
        self._probe_again = 0
        #: The length the last exploring round drafted (0: none), and how many more rounds
        #: of it a probe that paid gets.
        self._exploring = 0
        self._trial = 0
        #: Lengths timed again once as their few rounds ruled drafting out (_unconfirmed).
        self._confirmed: set[int] = set()
        #: Plain steps drafting after the warm-up (and a warm-up that kept nothing) has gained
        #: against plain decoding, net (negative: lost).
        self._balance = 0.0
        #: Tokens produced so far, plain and drafted.
        self._tokens = 0
        #: Drafted rounds ``(drafted, accepted, seconds or None: a length's first)`` the
        #: balance has yet to count, and the warm-up's, counted only if none kept a draft.
        self._unaccounted: list[tuple[int, int, float | None]] = []
        self._warmup: list[tuple[int, int, float | None]] = []
        #: The newest observations ``(drafted, accepted, seconds, use, at)``, ``use`` being
        #: "timed", "untimed" or "first" (a length's first round); for benchmarks only.
        self.told: deque[tuple[int, int, float, str, float]] = deque(maxlen=TOLD_KEPT)
        #: Plain steps the verifier runs before asking again, once ``choose`` said 0.
        self.stretch = PLAIN_STRETCH
        #: A recalled state's round costs by length (1..max_k), in plain steps; empty
        #: unless :meth:`recall` installed one.
        self._ratios: dict[int, float] = {}
        #: The plain-step timings the recalled costs rest on, and the seconds of a plain
        #: step where they were taken (a check, never an estimate: :meth:`_plain_stale`).
        self._recalled_timings = 0
        self._recalled_plain = 0.0

    # -- memory across processes ----------------------------------------------------

    def state(self) -> dict | None:
        """What this policy learned that another process can use (JSON-ready), or None
        before it could estimate a round's cost against a plain step: the acceptance counts
        per draft position (``[accepted, offered]``, decayed) and every length's round cost
        in plain steps (``costs[k - 1]``), never seconds."""
        times = self._round_times()
        if times is None or not self.adaptive:
            return None
        costs = [t / times[0] for t in times[1:]]
        # The costs rest on a few plain-step timings, each of one moment: a recalled state's
        # costs weigh as many timings as they rest on (at most STATE_TIMINGS), so the state
        # grows steadier over processes instead of taking the last one's luck.
        own, held = len(self._samples.get(0, ())), self._recalled_timings if self._ratios else 0
        if held and own:
            costs = [math.exp((own * math.log(c) + held * math.log(self._ratios[k])) /
                              (own + held)) for k, c in enumerate(costs, 1)]
        elif held:
            costs = [self._ratios[k] for k in range(1, self.max_k + 1)]
        return {"format": STATE_FORMAT, "max_k": self.max_k,
                "acceptance": [[round(a, 4), round(o, 4)]
                               for a, o in zip(*self._counts())],
                "costs": [round(max(c, 1.0), 4) for c in costs],
                "timings": min(own + held, STATE_TIMINGS),
                # Nothing timed here: the recalled plain step (times are in its units).
                "plain_s": times[0] if self._time else self._recalled_plain}

    def recall(self, state: object) -> None:
        """Start from ``state`` (another process's :meth:`state`) instead of nothing: see
        the module's "Memory". Only before this policy has been told anything.

        :raises ValueError: ``state`` is not a state this format describes (what is wrong)."""
        if self._drafted_rounds or self._time:
            raise ValueError("recall() must come before the policy's first round")
        accepted, offered, costs, timings, plain = checked_state(state)
        n = min(len(offered), self.max_k)
        scale = min(1.0, RECALLED_ROUNDS / max(offered[0], 1e-9))
        self._prior_accepted[:n] = [a * scale for a in accepted[:n]]
        self._prior_offered[:n] = [o * scale for o in offered[:n]]
        # Lengths past the state's longest: its last step per token goes on.
        step = costs[-1] - costs[-2] if len(costs) > 1 else max(costs[0] - 1.0, 0.0)
        costs = costs + [costs[-1] + step * i for i in range(1, self.max_k - len(costs) + 1)]
        self._ratios = {k: costs[k - 1] for k in range(1, self.max_k + 1)}
        self._recalled_timings, self._recalled_plain = timings, plain
        self._warmup_rounds = WARMUP_ROUNDS  # timings (another process's) win over a declaration

    # -- the model --------------------------------------------------------------------

    def acceptance(self, optimism: float = 0.0) -> list[float]:
        """Per position, the chance a draft is kept once every earlier one was. Each
        position's prior is the position before it (2 rounds' worth; the first: 1/2), so a
        position rarely reached borrows from its neighbour instead of sitting at 1/2, which
        would keep a good drafter from ever trying longer drafts. ``optimism`` > 0: that many
        standard errors higher (at most 1), wide while the evidence is thin."""
        rates, prior = [], 0.5
        for accepted, offered in zip(*self._counts()):
            prior = (accepted + PRIOR_ROUNDS * prior) / (offered + PRIOR_ROUNDS)
            spread = math.sqrt(prior * (1.0 - prior) / (offered + PRIOR_ROUNDS))
            rates.append(min(1.0, prior + optimism * spread))
        return rates

    def _counts(self) -> tuple[list[float], list[float]]:
        """Accepted and offered per position: this policy's own decayed counts plus what
        is left of a recalled state's."""
        return ([a + b for a, b in zip(self._accepted, self._prior_accepted)],
                [a + b for a, b in zip(self._offered, self._prior_offered)])

    def expected_tokens(self, k: int) -> float:
        return self._expected(self.acceptance())[k]

    @staticmethod
    def _expected(rates: list[float]) -> list[float]:
        """``E(k)`` for every ``k`` in ``0..max_k``, in one pass over ``rates``."""
        totals, total, chain = [1.0], 1.0, 1.0
        for rate in rates:
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
        """``T(k)`` for every ``k`` in ``0..max_k``, or None before a plain and a drafted
        round were timed. A plain step (``k = 0``) and a length timed three times or more
        are their own estimates; any other length comes from the Theil-Sen line through the
        drafted lengths' estimates (through the plain step and the one drafted length while
        only one is known), never below a plain step, and the plain step never above the
        cheapest drafted round. Plain steps fitted into the line let one slow drafted round
        raise their estimate threefold (self-drafting drafted on at a loss); a line through
        old estimates kept a length drafted at a loss its own recent rounds showed."""
        known = self._recalled_times() if self._ratios else self._time
        if 0 not in known or len(known) < 2:
            return None
        drafted = {x: y for x, y in known.items() if x > 0}
        # A drafted round runs the target over two tokens or more, which costs at least a
        # plain step: a plain stretch timed in a slow moment cannot make drafting look
        # cheaper than that.
        plain = min(known[0], *drafted.values())
        # A length timed once may have stalled that once: while others were timed more
        # often, it waits for its second round before it shapes the line (a recalled
        # length's cost rests on another process's many rounds: it counts as timed twice).
        trusted = {x: y for x, y in drafted.items()
                   if len(self._samples.get(x, ())) > 1 or x not in self._time}
        drafted = trusted or drafted
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
        # A length timed often enough is its own estimate: the line, through the lengths'
        # estimates whenever they were taken, is for the lengths it has to stand in for.
        return [plain] + [self._time[k] if len(self._samples.get(k, ())) >= 3
                          else max(intercept + slope * k, plain) for k in range(1, self.max_k + 1)]

    def _recalled_times(self) -> dict[int, float]:
        """Round times by length from the recalled costs, in this process's seconds: the
        plain step's own estimate once timed, else what this process's timed drafted rounds
        say it costs through the recalled ratios (their median), else one plain step as the
        unit (before anything was timed only ratios matter). Lengths timed here keep their
        own estimates; the others follow the recalled costs, scaled to those."""
        implied = [t / self._ratios[k] for k, t in self._time.items() if k in self._ratios]
        plain, scale = self._time.get(0), 1.0
        if plain is None:
            plain = statistics.median(implied) if implied else 1.0
        elif implied:
            # Both timed here: the recalled costs are scaled to what this process's rounds
            # cost (a drafter costing twice what the state says at one length is taken to
            # at every length), so they never keep a drafter on that this process times out.
            scale = statistics.median(implied) / plain
        known = {k: plain * r * scale for k, r in self._ratios.items()}
        known.update(self._time)
        known.setdefault(0, plain)
        return known

    def _recalled_plain_holds(self) -> bool:
        """Whether what this process's drafted rounds imply a plain step costs, through the
        recalled costs, is within :data:`PLAIN_DRIFT` of the recalled state's own plain
        step. Seconds from another process estimate nothing here (another load); they only
        say when the costs may have changed (a drafter that became dearer, a busier host),
        and plain steps are then timed at once."""
        implied = [t / self._ratios[k] for k, t in self._time.items() if k in self._ratios]
        if not implied:
            return True  # nothing timed yet: the recalled costs are all there is
        drift = statistics.median(implied) / self._recalled_plain
        return 1 / PLAIN_DRIFT <= drift <= PLAIN_DRIFT

    def exploring_allowed(self) -> bool:
        """Whether the budget allows a round that may lose against plain steps: drafting's
        net loss so far stays within EXPLORE_SHARE of the tokens seen (plus
        EXPLORE_ALLOWANCE). It grows with the tokens, so exploring is paced: a drafter that
        disagrees at a request's start is probed again as the request goes on."""
        return -self._balance < EXPLORE_ALLOWANCE + EXPLORE_SHARE * self._tokens

    # -- the loop ---------------------------------------------------------------------

    def choose(self, limit: int) -> int:
        """Tokens to ask the drafter for this round, at most ``limit``."""
        self._rounds += 1
        limit = min(limit, self.max_k)
        if limit <= 0:
            return 0
        self.stretch = PLAIN_STRETCH
        if not self.adaptive or (self._drafted_rounds < self._warmup_rounds and not self._ratios):
            return limit
        if 0 not in self._time and not self._ratios:
            self.stretch = TIMING_STRETCH
            return 0
        if self._probe_again:
            k, self._probe_again = self._probe_again, 0
            return min(k, limit)
        times = self._round_times()
        if times is None:  # no drafted round timed yet (each was a length's first, say)
            return min(self._declared_probe(), limit) if cannot_pay(self.draft_cost) else limit
        expected = self._expected(self.acceptance())
        rates = [e / t for e, t in zip(expected, times)]
        best = max(range(self.max_k + 1), key=rates.__getitem__)
        # Drafting must beat plain steps by more than the times' own noise (a rolling median
        # that dips by luck would keep a break-even drafter on), and by CLEAR_GAIN once it
        # has lost more than the budget.
        margin = CONFIDENCE * math.hypot(self._spread(best), self._spread(0))
        if not self.exploring_allowed():
            margin = max(margin, CLEAR_GAIN)
        if best and rates[best] < (1 + margin) * rates[0]:
            best = 0
        if best == 0:
            again = self._unconfirmed(expected)
            if again:
                # Timed again from plain steps (two rounds, the second timed), as a probe:
                # if it pays by itself, TRIAL_ROUNDS more outvote the rounds that ruled it out.
                self._confirmed.add(again)
                self._exploring, self._trial = again, 0
                return min(again, limit)
            self._exploring = self._explore(times)
            if self._exploring and self._plain_stale():
                return 0
            return min(self._exploring, limit)
        self._exploring = self._trial = 0
        # Drafting pays: how long, among the lengths that pay, judged optimistically, so a
        # position whose few rounds went badly is reached again instead of never drafted
        # to (its evidence then never changes).
        hopeful = self._expected(self.acceptance(LENGTH_OPTIMISM))
        paying = [n for n in range(1, self.max_k + 1) if rates[n] >= (1 + margin) * rates[0]]
        k = best = max(paying, key=lambda n: hopeful[n] / times[n])
        if self._plain_stale():
            return 0
        if self._rounds >= self._next_probe:
            self._next_probe = self._rounds + PROBE_EVERY
            self._probes += 1
            if self._probes % 2:
                k = best - 1 if best == self.max_k else best + 1
            else:
                k = self._stale_probe(rates, expected) or k
        return min(k, limit)

    def _spread(self, n: int) -> float:
        """The relative standard error of length ``n``'s time estimate: from its samples'
        median absolute deviation once there are three, else :data:`THIN_SPREAD`."""
        recent = self._samples.get(n, ())
        if len(recent) < 3:
            return THIN_SPREAD
        middle = statistics.median(recent)
        deviation = statistics.median(abs(x - middle) for x in recent)
        # 1.4826 MAD estimates a standard deviation; a median's error is ~1.25x a mean's.
        return 1.25 * 1.4826 * deviation / middle / math.sqrt(len(recent))

    def _plain_stale(self) -> bool:
        """Whether to time plain steps instead of drafting now (setting the stretch): soon
        while their estimate rests on one short stretch (perhaps of a slow moment), then
        whenever it is STALE_ROUNDS old. Recalled costs, resting on more timings than a
        request could take, stand in for a first timing while :meth:`_recalled_plain_holds`."""
        timed = len(self._samples.get(0, ()))
        if not timed and self._ratios:
            after = STALE_ROUNDS if self._recalled_plain_holds() else 0
        else:
            after = STALE_ROUNDS if self._ratios or timed > 1 else PROBE_EVERY // 2
        if self._rounds - self._timed_at.get(0, 0) <= after:
            return False
        self.stretch = TIMING_STRETCH
        return True

    def _explore(self, times: list[float]) -> int:
        """Plain steps pay best on the mean estimates. Within the budget: more rounds of a
        probe whose timed round paid by itself (TRIAL_ROUNDS: enough fresh times to outvote
        what a busy moment left in the estimates); else the length that pays best on the
        optimistic acceptance, if that beats plain steps; else, every PROBE_EVERY rounds, a
        length whose time may be out of date (:meth:`_stale_probe`); else 0."""
        if not self.exploring_allowed():
            return 0
        if self._trial:
            self._trial -= 1
            return self._exploring
        hopeful = self._expected(self.acceptance(OPTIMISM))
        rates = [e / t for e, t in zip(hopeful, times)]
        k = max(range(1, self.max_k + 1), key=rates.__getitem__)
        if rates[k] > rates[0]:
            return k
        if self._rounds >= self._next_probe:
            self._next_probe = self._rounds + PROBE_EVERY
            mean = self._expected(self.acceptance())
            return self._stale_probe([e / t for e, t in zip(mean, times)], mean) or 0
        return 0

    def _unconfirmed(self, expected: list[float]) -> int | None:
        """While no drafted length has been timed three times, every drafted time rests on
        rounds of one moment (the warm-up's two timed rounds follow each other; a burst there
        left a paying drafter off: decisions.md, item 16): a length whose rounds would yield
        UNCONFIRMED tokens on the mean acceptance is then timed once more before its cost
        switches drafting off, whatever the budget (even where a declared cost agrees)."""
        if any(n and len(r) >= 3 for n, r in self._samples.items()):
            return None  # a length was timed at several moments: probes and budget decide
        thin = [n for n in self._time if n and n not in self._confirmed
                and n <= self.max_k and expected[n] > UNCONFIRMED]
        return max(thin, key=lambda n: expected[n] / self._time[n]) if thin else None

    def _declared_probe(self) -> int:
        """No length can pay at the declared cost, none timed: plain steps, but k = 1 (the
        cheapest timing to overrule it) once they are timed, then each PROBE_EVERY in budget."""
        if not self.exploring_allowed() or (
                self._drafted_rounds and self._rounds < self._next_probe):
            return 0
        self._next_probe = self._rounds + PROBE_EVERY
        return 1

    def _stale_probe(self, rates: list[float], expected: list[float]) -> int | None:
        """The length timed longest ago among those that would beat the best one by a
        quarter if their round cost no more than a plain step (a drafter that never agrees
        is not probed at lengths that cannot pay); None when there is none."""
        best, floor = max(rates), expected[0] / rates[0]  # a plain step's time
        hopeful = [n for n in range(1, self.max_k + 1) if expected[n] / floor > 1.25 * best]
        return min(hopeful, key=lambda n: self._timed_at.get(n, -1)) if hopeful else None

    def observe(self, drafted: int, accepted: int, seconds: float, *,
                one_off: bool = False, fed: bool = False) -> None:
        """A round drafted ``drafted`` tokens, the target kept ``accepted``, in ``seconds``
        (for a plain stretch, ``drafted = 0`` and the seconds of one of its steps);
        ``one_off``: it paid a one-off cost besides (a graph traced for a new shape, say), so
        its time says nothing of what the length costs, and a probe runs another round;
        ``fed``: it first fed the drafter its request's sequence (a drafter waits for its
        first draft to hear it), a switch back as below.

        A drafted round right after plain steps is not timed: it also pays for switching
        back (a model drafter catches up on every plain token since its last draft, the
        pipeline refills). So a probe from plain steps runs two rounds, the second timed: a
        drafter is judged by what its rounds cost while it drafts; the budget counts both
        (a look that wakes a request's drafter pays for feeding it: left out, looks at a
        drafter that never paid came each request, not each 2% of the tokens)."""
        switching = bool(drafted) and (self._after_plain or fed)
        self._after_plain = not drafted
        untimed = switching or (one_off and bool(drafted))
        # A plain stretch's first step is never timed (the verifier's doing), so nothing of
        # a first use is left in its time.
        first = bool(drafted) and drafted not in self._seen and not untimed
        if untimed and self._drafted_rounds >= self._warmup_rounds:
            self._probe_again = drafted
        if drafted:
            self._tokens += 1 + accepted
            if not one_off:
                # A length's first round (it may have compiled kernels) counts at its estimate.
                spent = self._warmup if self._drafted_rounds < self._warmup_rounds \
                    else self._unaccounted
                spent.append((drafted, accepted, None if first else seconds))
            self._learn(drafted, accepted, timed=not (untimed or first))
            self._drafted_rounds += 1
            if self._drafted_rounds == self._warmup_rounds \
                    and not any(kept for _, kept, _ in self._warmup):
                self._unaccounted.extend(self._warmup)
        else:
            self._tokens += self.stretch
            self._fade()
        if untimed:
            self._seen.add(drafted)  # it paid this length's first-use costs too
            self.told.append((drafted, accepted, seconds, "untimed", time.perf_counter()))
            return
        if first:
            # A length's first round pays its one-off costs (on CUDA MLX compiles each new
            # window shape's kernels, seconds): timed, it kept an 88% drafter under 1 token.
            self._seen.add(drafted)
            self.told.append((drafted, accepted, seconds, "first", time.perf_counter()))
            return
        self.told.append((drafted, accepted, seconds, "timed", time.perf_counter()))
        if drafted and drafted == self._exploring and not self._trial:
            plain = self.round_time(0)
            self._trial = TRIAL_ROUNDS if plain and seconds <= (1 + accepted) * plain else 0
        recent = self._samples.setdefault(drafted, deque(maxlen=TIME_SAMPLES))
        if not drafted and self._rounds - self._timed_at.get(0, self._rounds) > STALE_ROUNDS:
            # Timed again because stale: the older times are of another moment, and three of
            # them, from a slow one, outvoted each fresh time for 3 x STALE_ROUNDS rounds.
            recent.clear()
        self._timed_at[drafted] = self._rounds
        recent.append(seconds)
        self._time[drafted] = typical(recent)
        self._account()

    def _learn(self, drafted: int, accepted: int, timed: bool) -> None:
        checked = timed or any(n > 0 for n in self._samples)
        if not accepted and checked and self._prior_offered[0] > 0:
            # A round that kept nothing is evidence the recalled state describes other text:
            # what is left of it keeps the chance it gave that outcome, at every position
            # (faded only where a round reached, its paying rates further on kept a
            # never-agreeing drafter drafting). Only once a round was timed here: a busy
            # process's state would otherwise stop drafting on costs never checked.
            keep = 1.0 - self._prior_accepted[0] / self._prior_offered[0]
            self._prior_offered = [o * keep for o in self._prior_offered]
            self._prior_accepted = [a * keep for a in self._prior_accepted]
        for i in range(drafted):
            self._offered[i] = self._offered[i] * DECAY + 1.0
            self._accepted[i] = self._accepted[i] * DECAY + (1.0 if i < accepted else 0.0)
            self._prior_offered[i] *= RECALL_FADE
            self._prior_accepted[i] *= RECALL_FADE
            if i >= accepted:
                break

    def _fade(self) -> None:
        """A plain stretch: the text moved on, so what the drafter did before weighs less,
        though never less than AGED_ROUNDS rounds."""
        for i, offered in enumerate(self._offered):
            if offered > AGED_ROUNDS:
                scale = max(STRETCH_DECAY, AGED_ROUNDS / offered)
                self._offered[i] *= scale
                self._accepted[i] *= scale

    def _account(self) -> None:
        """The drafted rounds not yet counted into the balance, against the plain-step
        estimate of the moment, once there is one. Each counts at its own time (what
        drafting really cost, not what the estimates that chose it said), at most LOSS_CAP
        times its length's estimate (a stall); a length's first round at the estimate."""
        times = self._round_times()
        if times is None:
            return
        plain = times[0]
        for drafted, accepted, seconds in self._unaccounted:
            # The length's own estimate once timed twice: the fit never goes below a plain
            # step, which would make a round that yields one token look free.
            estimate = times[min(drafted, self.max_k)]
            if len(self._samples.get(drafted, ())) > 1:
                estimate = self._time[drafted]
            cost = estimate if seconds is None else min(seconds, LOSS_CAP * estimate)
            self._balance += 1 + accepted - cost / plain
        self._unaccounted.clear()


def typical(recent: Sequence[float]) -> float:
    """What a round of one length costs, from its recent times: their median, the least of
    them while there are fewer than three (not the least of all: on a host whose speed swings
    the least drafted round is the luckier draw; docs/decisions.md)."""
    return min(recent) if len(recent) < 3 else statistics.median(recent)
