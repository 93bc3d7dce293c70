"""The adaptive draft length follows what the drafter and the machine measure: a drafter
that does not pay is switched off (plain steps), one that pays drafts long, a few bad rounds
do not condemn a drafter, and no decision hinges on one noisy time.

The simulations drive the policy as the verifier does: a round the policy answers 0 to is a
plain stretch of ``policy.stretch`` steps reporting the time of one of them, a drafted round
its own time. Speeds are computed from the true costs, never timed."""

from __future__ import annotations

import random
import statistics

from foretell.spec.policy import (
    EXPLORE_ALLOWANCE,
    EXPLORE_SHARE,
    PLAIN_STRETCH,
    PROBE_EVERY,
    STALE_ROUNDS,
    DraftLengthPolicy,
)


def _simulate(acceptance: float, plain_s: float, draft_token_s: float, verify_s: float,
              rounds: int = 400, seed: int = 0) -> list[tuple[int, int]]:
    """Run the policy against a simulated drafter; return ``(k, tokens)`` per round."""
    rng = random.Random(seed)
    policy = DraftLengthPolicy(6)
    chosen = []
    for _ in range(rounds):
        k = policy.choose(100)
        if k == 0:
            chosen.append((0, policy.stretch))
            policy.observe(0, 0, plain_s)
            continue
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        chosen.append((k, 1 + accepted))
        policy.observe(k, accepted, verify_s + k * draft_token_s)
    return chosen


def _speed_over_plain(plain_s, draft_token_s, verify_s, chosen) -> float:
    tokens = seconds = 0.0
    for k, made in chosen:
        tokens += made
        seconds += made * plain_s if k == 0 else verify_s + k * draft_token_s
    return tokens / seconds * plain_s


def test_a_drafter_that_never_agrees_is_switched_off_within_five_percent():
    chosen = _simulate(acceptance=0.0, plain_s=0.010, draft_token_s=0.004, verify_s=0.012)
    late = chosen[100:]
    assert sum(k == 0 for k, _ in late) / len(late) > 1 - 2 / PROBE_EVERY
    assert _speed_over_plain(0.010, 0.004, 0.012, late) >= 0.95


def test_a_cheap_accurate_drafter_drafts_long():
    chosen = _simulate(acceptance=0.95, plain_s=0.010, draft_token_s=0.001, verify_s=0.012)
    late = [k for k, _ in chosen[100:]]
    assert sorted(late)[len(late) // 2] >= 5


def test_a_costly_drafter_is_used_only_where_it_pays():
    # Drafting one token costs as much as a plain step: even 80% acceptance cannot pay.
    chosen = _simulate(acceptance=0.8, plain_s=0.010, draft_token_s=0.010, verify_s=0.011)
    late = chosen[100:]
    assert sum(k == 0 for k, _ in late) / len(late) > 0.8
    assert _speed_over_plain(0.010, 0.010, 0.011, late) >= 0.95


def test_without_adaptation_the_policy_drafts_the_most_it_may():
    policy = DraftLengthPolicy(4, adaptive=False)
    policy.observe(4, 0, 1.0)
    policy.observe(0, 0, 0.001)
    assert [policy.choose(limit) for limit in (10, 3, 0)] == [4, 3, 0]


def _simulate_with_stalls(stall_s: dict[int, float], stall_rounds: dict[int, float],
                          rounds: int = 400, seed: int = 1, occurrence: int = 1) -> list[int]:
    """A GPU-like drafter (88% acceptance, verify nearly flat in k), where the first round
    of each length costs ``stall_s[k]`` extra (kernels compiled on first use) and the
    rounds in ``stall_rounds`` cost that much extra (a busy host)."""
    rng = random.Random(seed)
    policy = DraftLengthPolicy(6)
    seen: dict[int, int] = {}
    chosen = []
    for r in range(rounds):
        k = policy.choose(100)
        chosen.append(k)
        seen[k] = seen.get(k, 0) + 1
        extra = stall_rounds.get(r, 0.0) + (stall_s.get(k, 0.0) if seen[k] == occurrence else 0.0)
        accepted = 0
        while accepted < k and rng.random() < 0.88:
            accepted += 1
        policy.observe(k, accepted, (0.0011 if k == 0 else 0.0015 + 0.0004 * k) + extra)
    return chosen


def test_kernels_compiled_on_a_lengths_first_round_do_not_switch_that_length_off():
    # Measured on the H200: a window shape's first round compiled kernels for seconds,
    # and a policy that timed it drafted under one token a round at 88% acceptance.
    # (A plain stretch's first step, where its kernels compile, is never timed.)
    assert _simulate_with_stalls({k: 2.0 for k in range(1, 7)}, {}) == _simulate_with_stalls({}, {})


def test_a_stalled_round_does_not_switch_a_good_length_off_for_good():
    # Round 2 (the longest length's second round) stalls for a second: the estimate may
    # suffer for a while, but probing re-measures the length and drafting comes back.
    chosen = _simulate_with_stalls({}, {2: 1.0}, rounds=600)
    late = chosen[300:]
    assert sorted(late)[len(late) // 2] >= 3


def test_a_slow_drafted_round_does_not_raise_the_plain_steps_estimate():
    # Self-drafting on a CPU: every drafted token costs a plain step, all are accepted,
    # and one drafted round runs slow (a busy host). Measured there: fitting plain steps
    # into the drafted rounds' line tripled the plain estimate and drafting stayed on.
    policy, chosen, timed = DraftLengthPolicy(4), [], {}
    for _ in range(300):
        k = policy.choose(100)
        chosen.append(k)
        timed[k] = timed.get(k, 0) + 1
        seconds = 0.022 * (k + 1) * (1.1 if k else 1.0)
        if k == 2 and timed[k] == 2:
            seconds += 0.2
        policy.observe(k, k, seconds)
    late = chosen[100:]
    # Drafting stays off: drafted rounds come only as probes (two rounds each, at most).
    assert sum(k == 0 for k in late) / len(late) > 0.7
    runs = "".join("d" if k else "." for k in late).split(".")
    assert max(len(run) for run in runs) <= 2


def _self_drafting_on_a_swinging_host(seed: int, swing: float = 0.3, rounds: int = 600
                                      ) -> float:
    """A target drafting for itself on a busy CPU (every draft costs a plain step, 95%
    kept) while each time the policy sees swings (lognormal, ``swing`` wide): plain stretches
    report the mean of their steps, drafted rounds one round each, as the verifier times
    them. Returns the speed of rounds 100 on, from the true costs, over plain decoding."""
    rng = random.Random(seed)
    policy, plain = DraftLengthPolicy(6), 0.033
    tokens = seconds = 0.0
    for r in range(rounds):
        k = policy.choose(100)
        if k == 0:
            made = policy.stretch
            steps = [plain * rng.lognormvariate(0, swing) for _ in range(made)]
            policy.observe(0, 0, sum(steps) / made)
            cost = made * plain
        else:
            accepted = 0
            while accepted < k and rng.random() < 0.95:
                accepted += 1
            cost = plain * k + plain * (1.0 + 0.04 * k)
            policy.observe(k, accepted, cost * rng.lognormvariate(0, swing))
            made = 1 + accepted
        if r >= 100:
            tokens, seconds = tokens + made, seconds + cost
    return tokens / seconds * plain


def test_a_drafter_that_breaks_even_stays_within_five_percent_on_a_swinging_host():
    # Taking the least of each length's recent times compared the luckiest single drafted
    # round with the luckiest mean of 8 plain steps: drafting at a loss, 0.91x plain on
    # seed 2 (0.79x and 0.89x measured on the busy 2-core Xeon, paired). Over many seeds:
    # which ones meet a run of lucky times moves with any change to the schedule (the worst
    # of forty 0.912x with 4-step plain timings, 0.917x now; the mean 0.968x, 0.971x).
    speeds = [_self_drafting_on_a_swinging_host(seed) for seed in range(40)]
    assert statistics.mean(speeds) >= 0.96, speeds
    assert sum(speed < 0.93 for speed in speeds) <= 2, speeds


def test_a_plain_step_timed_in_a_slow_moment_does_not_keep_drafting_on():
    """A target drafting for itself on a CPU, every draft kept, its rounds costing what the
    2-core Xeon measured (2.3 plain steps at k = 1, 3.9 at 2, 7.8 at 4): drafting never
    pays. Its plain steps were timed while the host was slow (twice their cost), then
    drafting won on that estimate. While drafting, plain steps used to be timed never
    again, so it drafted for good (0.85x here, 0.99x now; on the 2-core Xeon the estimate
    read 65.6 ms against plain's ~37, and self-drafting ran 0.75x). A plain stretch timed
    once the estimate is STALE_ROUNDS old brings it back."""
    policy, slow = DraftLengthPolicy(4), 0
    tokens = cost = 0.0
    for r in range(1500):
        k = policy.choose(100)
        if k == 0:
            slow += 1
            made = policy.stretch
            policy.observe(0, 0, 2.0 if slow <= 5 else 1.0)  # the first five in a slow moment
            spent = made * 1.0
        else:
            policy.observe(k, k, 0.5 + 1.8 * k)  # the Xeon's self-drafting rounds
            made, spent = k + 1, 0.5 + 1.8 * k
        if r >= 750:
            tokens, cost = tokens + made, cost + spent
    assert tokens / cost >= 0.95


def test_plain_steps_timed_again_as_stale_stand_alone():
    """Plain steps timed slow (twice their cost) at the start (a warm-up on a GPU meeting new
    shapes), then drafting won on that estimate: a two-model round costing 2.9-5.1 plain
    steps, as on the H100's demo at B = 1, never pays. Once the estimate is STALE_ROUNDS old
    plain steps are timed again, and that fresh time alone is the estimate: it used to be one
    of up to five whose median the slow ones held, so drafting ran on at a loss for up to
    three times as long (the H100's two-model rows at B = 1 ran 0.61x plain over an 11-turn
    bench). After the re-timing only looks draft (two rounds every PROBE_EVERY)."""
    policy, drafted = DraftLengthPolicy(3), []
    for r in range(3 * STALE_ROUNDS):
        k = policy.choose(100)
        if k == 0:
            policy.observe(0, 0, 2.0 if r < 20 else 1.0)
        else:
            policy.observe(k, k, {1: 2.9, 2: 4.0, 3: 5.1}[k])
            drafted.append(r)
    after = [r for r in drafted if r > STALE_ROUNDS + 20]
    assert len(after) <= 2 * (2 * STALE_ROUNDS - 20) / PROBE_EVERY + 2, drafted


def _requests_waking_a_losing_drafter(seed: int, fed: bool) -> float:
    """60 requests of 64 tokens through one policy, a drafter that never pays (the H100's
    demo two-model rounds at B = 1: 2.9 / 4.0 / 5.1 plain steps at k = 1 / 2 / 3, 80% kept,
    10% noise); each request's first drafted round also feeds its drafter the sequence (4
    plain steps), told as ``fed`` or, as before, as a one-off. Returns the speed over plain
    decoding's of requests 10 on, from the true costs."""
    rng = random.Random(seed)
    policy, made_all, spent_all = DraftLengthPolicy(3), 0.0, 0.0
    for request in range(60):
        made, woken = 0, False
        while made < 64:
            k = policy.choose(min(3, 63 - made))
            time = rng.lognormvariate(0, 0.1)
            if k:
                accepted = 0
                while accepted < k and rng.random() < 0.8:
                    accepted += 1
                spent = {1: 2.9, 2: 4.0, 3: 5.1}[k] * time + (0.0 if woken else 4.0)
                policy.observe(k, accepted, spent, **{"fed" if fed else "one_off": not woken})
                woken, got = True, 1 + accepted
            else:
                got = min(policy.stretch, 64 - made)
                policy.observe(0, 0, time)
                spent = got * time
            made += got
            if request >= 10:
                made_all, spent_all = made_all + got, spent_all + spent
    return made_all / spent_all


def test_a_look_that_wakes_a_requests_drafter_pays_for_it_from_the_budget():
    """A request's drafter hears its sequence only when the request first drafts, so each
    request's first look also feeds it. Told as a one-off, that cost stayed out of the
    exploring budget and a drafter that never paid was looked at in every request: 0.94x
    plain here (the H100's two-model rows at B = 1 ran 0.87x over 22 turns). Counted, looks
    come each 2% of the tokens: 0.97x."""
    before = [_requests_waking_a_losing_drafter(seed, fed=False) for seed in range(6)]
    after = [_requests_waking_a_losing_drafter(seed, fed=True) for seed in range(6)]
    assert statistics.mean(before) < 0.95  # the loss this pins
    assert min(after) >= 0.96, after


def test_a_round_that_fed_the_drafter_is_untimed_but_counted():
    """A round that first fed the drafter its sequence says nothing of what its length
    costs, but what it cost counts against the exploring budget (a one-off does not)."""
    def policy_after(**told) -> DraftLengthPolicy:
        policy = DraftLengthPolicy(2)
        for _ in range(3):  # the warm-up's rounds, all kept
            policy.observe(2, 2, 0.030)
        policy.observe(0, 0, 0.010)
        policy.observe(0, 0, 0.010)
        policy.observe(2, 2, 0.030)  # after plain steps: untimed
        policy.observe(2, 2, 0.030)  # 3 plain steps for 3 tokens: even
        assert policy.exploring_allowed()
        policy.observe(2, 0, 0.090, **told)  # 6 plain steps (LOSS_CAP x 3) for 1 token
        assert policy.told[-1][3] == "untimed"  # its time is not the length's
        policy.observe(2, 2, 0.030)
        return policy

    assert not policy_after(fed=True).exploring_allowed()
    assert policy_after(one_off=True).exploring_allowed()


def _losing_drafter_on_a_host_in_phases(seed: int, slow: float = 1.8, rounds: int = 3000
                                        ) -> float:
    """Sampled MTP as the H200 measured it (2026-12-03): a round drafting k costs 2.3 + 0.4k
    plain steps, each draft kept with probability 0.7, so every k loses ~30% against plain
    steps; the host's speed flips between 1 and ``slow`` in phases of 50-400 policy rounds
    (plain decoding there swung 545-1,157 tok/s from one request to the next), with 10%
    noise on every time. Returns the speed of rounds 200 on over plain decoding's in the
    same phases, from the true costs."""
    rng = random.Random(seed)
    policy, factor, left = DraftLengthPolicy(6), 1.0, rng.randint(50, 400)
    tokens = seconds = plain_seconds = 0.0
    for r in range(rounds):
        left -= 1
        if left <= 0:
            factor, left = (slow if factor == 1.0 else 1.0), rng.randint(50, 400)
        k = policy.choose(100)
        time = factor * rng.lognormvariate(0, 0.1)
        if k == 0:
            policy.observe(0, 0, time)
            made = policy.stretch
            spent = made * time
        else:
            accepted = 0
            while accepted < k and rng.random() < 0.7:
                accepted += 1
            spent = (2.3 + 0.4 * k) * time
            policy.observe(k, accepted, spent)
            made = 1 + accepted
        if r >= 200:
            tokens, seconds, plain_seconds = tokens + made, seconds + spent, plain_seconds + made * factor
    return plain_seconds / seconds


def test_a_losing_drafter_stays_within_about_five_percent_on_a_host_whose_speed_flips_in_phases():
    """Plain steps timed in a slow phase make drafting look like a gain until they are timed
    again. With each estimate the median of its recent times and plain steps re-timed while
    drafting (STALE_ROUNDS), it runs 0.97x plain on average over these seeds (taking the
    least of the recent times drafted at 0.90x on two of eight when this test was written).
    A request whose plain steps were timed in a slow phase still drafts at a loss until they
    are timed again, up to STALE_ROUNDS rounds; a time taken again as stale used to be one of
    five whose median the slow ones held (0.88x over a whole run on one seed in forty; the
    worst 0.966x since it stands alone). Which seeds meet a phase at the wrong moment moves
    with any change to the schedule (a 3-step timing stretch instead of 4 moved the worst of
    the first eight from 0.949x to 0.927x), so the bounds are over many. This does
    not reproduce the H200's 0.80x for sampled MTP at 09:38
    (docs/benchmarks.md): whatever made its plain-step estimate read 1.6x plain decoding's
    step there is not a phase of this kind."""
    speeds = [_losing_drafter_on_a_host_in_phases(seed) for seed in range(40)]
    assert statistics.mean(speeds) >= 0.96, speeds
    assert min(speeds) >= 0.94, speeds


def test_the_policy_keeps_what_it_was_told_and_how_it_used_each_time():
    from foretell.spec.policy import TOLD_KEPT

    policy = DraftLengthPolicy(4)
    policy.observe(4, 4, 0.030)  # a length's first round: not timed (it compiles on CUDA)
    policy.observe(4, 2, 0.020)
    policy.observe(0, 0, 0.010)  # a plain stretch: timed (its first step never is)
    policy.observe(0, 0, 0.011)
    policy.observe(4, 3, 0.050)  # right after plain steps: a switch back, not timed
    policy.observe(4, 1, 0.021, one_off=True)
    assert [(k, kept, round(s, 3), use) for k, kept, s, use, _at in policy.told] == [
        (4, 4, 0.03, "first"), (4, 2, 0.02, "timed"), (0, 0, 0.01, "timed"),
        (0, 0, 0.011, "timed"), (4, 3, 0.05, "untimed"), (4, 1, 0.021, "untimed")]
    ats = [at for *_rest, at in policy.told]
    assert ats == sorted(ats)
    # Only the timed ones made the estimates.
    assert policy.measured() == {0: 0.010, 4: 0.020}
    for _ in range(2 * TOLD_KEPT):
        policy.observe(0, 0, 0.012)
    assert len(policy.told) == TOLD_KEPT and policy.told[0][2] == 0.012


def _exploring_loss(verify_s: float, rounds: int = 400) -> tuple[float, int, int]:
    """A drafter that never agrees, each round costing ``verify_s`` against a 10 ms plain
    step: what drafting lost after the warm-up, in plain steps, the tokens, and the drafted
    rounds."""
    policy, lost, tokens, drafted = DraftLengthPolicy(4), 0.0, 0, 0
    for r in range(rounds):
        k = policy.choose(100)
        if k == 0:
            tokens += policy.stretch
            policy.observe(0, 0, 0.010)
            continue
        tokens += 1
        policy.observe(k, 0, verify_s)
        if r >= 3:
            lost, drafted = lost + verify_s / 0.010 - 1, drafted + 1
    return lost, tokens, drafted


def test_probes_of_a_switched_off_drafter_cost_at_most_the_budget():
    # A failed probe of prompt lookup costs a longer verify than a plain step (0.6 of a
    # step here): probed every few stretches, it costs its budget and is back soon once it
    # pays.
    lost, tokens, drafted = _exploring_loss(0.016)
    assert drafted >= 40  # probed, often
    assert lost <= EXPLORE_ALLOWANCE + EXPLORE_SHARE * tokens + 0.6 * 2


def test_a_costly_probe_is_rare():
    # A model drafter's probe also catches up on every plain token since its last draft
    # (here 30 plain steps' worth a round): the budget pays for one every ~1,500 tokens.
    lost, tokens, drafted = _exploring_loss(0.31)
    assert lost <= EXPLORE_ALLOWANCE + EXPLORE_SHARE * tokens + 30 * 2
    assert drafted <= 2 + EXPLORE_SHARE * tokens / 30 * 2


def test_drafting_comes_back_once_it_pays_after_probes_backed_off():
    policy = DraftLengthPolicy(4)
    for _ in range(300):  # a drafter that never agrees: plain steps win, probes back off
        k = policy.choose(100)
        policy.observe(k, 0, 0.010 if k == 0 else 0.012 + 0.004 * k)
    chosen = []
    for _ in range(400):  # now every draft is kept and drafting is cheap
        k = policy.choose(100)
        policy.observe(k, k, 0.010 if k == 0 else 0.011 + 0.0005 * k)
        chosen.append(k)
    assert sum(k > 0 for k in chosen[-100:]) >= 90


def test_a_stall_in_a_lengths_first_timed_round_is_outvoted():
    # Measured on the H200: MTP's first timed round at one length took 61 ms against ~2 ms
    # (a kernel of a drafter-side shape compiling), and a running mean kept it switched off.
    for length in (6, 5):  # the warm-up's length, the first one chosen after it
        stalled = _simulate_with_stalls({length: 0.06}, {}, occurrence=2)
        late = stalled[150:]
        assert sorted(late)[len(late) // 2] >= 3, length


def test_a_drafter_whose_switch_back_is_costly_is_judged_by_its_rounds_while_drafting():
    """A model drafter (MTP on the H200: 90% acceptance, steady rounds 1.2x plain) whose
    rounds ran slow at first (a busy host), so it was switched off. The first round after
    plain steps also catches it up on every plain token since its last draft. Probes time
    the round after that one, so drafting comes back once its rounds pay; timing the
    catch-up round instead kept it off for good."""
    policy, plain_s, since_draft, chosen = DraftLengthPolicy(4), 0.0009, 0, []
    rng = random.Random(3)
    for r in range(900):
        k = policy.choose(100)
        chosen.append(k)
        if k == 0:
            since_draft += policy.stretch
            policy.observe(0, 0, plain_s)
            continue
        accepted = 0
        while accepted < k and rng.random() < 0.9:
            accepted += 1
        busy = 1.6 if r < 300 else 1.0
        catch_up = 0.0003 * since_draft
        since_draft = 0
        policy.observe(k, accepted, busy * (0.0015 + 0.00035 * k) + catch_up)
    assert sum(k == 0 for k in chosen[200:300]) > 80  # off while its rounds did not pay
    late = chosen[750:]
    assert sum(k > 0 for k in late) / len(late) > 0.8


def test_drafted_rounds_that_were_never_timed_lead_to_a_timed_one_not_an_error():
    """Every drafted round so far was a length's first or a switch back from plain steps
    (prompt lookup drafting 4, 3, then 2 tokens): none was timed, so the policy drafts
    again to time one (a probe's second round is timed even at a new length)."""
    policy = DraftLengthPolicy(4)
    for n in (4, 3, 2):
        assert policy.choose(100) == 4
        policy.observe(n, 0, 0.01)
    assert policy.choose(100) == 0  # plain steps are timed first, in a short stretch
    assert policy.stretch < PLAIN_STRETCH
    policy.observe(0, 0, 0.005)
    assert policy.choose(100) == 4
    policy.observe(1, 1, 0.02)  # a switch back, at a new length: not timed
    assert policy.round_time(1) is None and policy.choose(100) >= 1
    policy.observe(1, 1, 0.012)
    assert policy.round_time(1) is not None and policy.measured() == {0: 0.005, 1: 0.012}


def test_a_round_that_paid_a_one_off_cost_is_not_timed_and_a_probe_runs_again():
    """On CUDA a round may trace a fixed-shape forward for a new window length or cache
    capacity (foretell.model.fixed); the verifier flags it and the policy keeps its time
    out of the length's estimate. A probe whose timed round was such a round runs one more
    (measured on the H200: probes of k = 1 and 2 timed at 4-5 ms against ~3 ms steady,
    right after the caches' capacity grew, kept MTP switched off)."""
    policy = DraftLengthPolicy(4)
    for _ in range(3):  # warm-up drafted rounds (the first one untimed)
        assert policy.choose(100) == 4
        policy.observe(4, 4, 0.004)
    assert policy.measured() == {4: 0.004}
    # Switched off by a drafter that stops agreeing, then a probe from plain steps.
    for _ in range(20):
        if policy.choose(100) == 0:
            policy.observe(0, 0, 0.002)
        else:
            policy.observe(4, 0, 0.004)
    for _ in range(200):
        if (k := policy.choose(100)) != 0:
            break
        policy.observe(0, 0, 0.002)
    assert k > 0  # the budget paid for a probe
    policy.observe(k, 0, 0.004)  # the switch back: untimed, the probe goes on
    again = policy.choose(100)
    assert again == k
    policy.observe(again, 0, 0.5, one_off=True)  # it traced: untimed, and once more
    assert policy.choose(100) == k
    assert policy.measured().get(k, 0.0) < 0.5


def _late_bloomer(seed: int, tokens: int = 256) -> float:
    """A drafter that disagrees for the first 20 tokens of each request (the start of a
    continuation it cannot guess: MTP on the demo's code prompt accepted ~1 of 6 drafts
    there, later ~4.5), then agrees 92% of the time; H200-like costs (fixed shapes): a round
    drafting k costs 2.2 + 0.5 k ms against a 1.2 ms plain step, so k = 4 pays ~1.2x once it
    agrees. Two requests share the policy; returns the second one's share of drafted rounds."""
    rng, policy = random.Random(seed), DraftLengthPolicy(4)
    for _request in range(2):
        produced, chosen = 0, []
        while produced < tokens:
            k = policy.choose(100)
            chosen.append(k)
            if k == 0:
                policy.observe(0, 0, 0.0012)
                produced += policy.stretch
                continue
            rate, accepted = (0.3 if produced < 20 else 0.92), 0
            while accepted < k and rng.random() < rate:
                accepted += 1
            policy.observe(k, accepted, 0.0022 + 0.0005 * k)
            produced += accepted + 1
    return sum(k > 0 for k in chosen) / len(chosen)


def test_a_drafter_switched_off_early_comes_back_once_it_agrees():
    """The warm-up's rounds fell in the part that disagrees, so drafting went off. A probe
    from plain steps drafts the most it may (it hears of every position), the evidence from
    before the plain steps weighs less the longer they ran, and a probe that paid drafts on
    for a few rounds: so the second request drafts most of its rounds. Probing with one
    token, whose fixed verify cost cannot pay, left it off (a share of ~0.12)."""
    shares = [_late_bloomer(seed) for seed in range(8)]
    assert sum(shares) / len(shares) > 0.5


# -- issue 48: a drafter that pays is not given up on; none hinges on one timing -----------

#: The demo's two-model drafter on the 2-core CPU, as outside testing measured it on a
#: held-out code prompt: plain 44 tok/s, fixed k = 3 at 1.87x (60 of 106 drafts kept). A
#: round drafting k costs 1.07 + 0.125 k plain steps; each draft agrees with probability
#: 0.74 (whether it does is a fact of the text position, as greedy drafts are).
CPU_ROUND = (1.07, 0.125)
AGREES = 0.74


def _request(policy, agrees, tokens: int = 100, round_cost=CPU_ROUND, seed: int = 0,
             noise: float = 0.1, catch_up: float = 0.02, first_plain=1.0, first_drafted=1.0,
             drafted_at=None, slow_drafted=None):
    """One greedy request of ``tokens`` driven by ``policy`` (None: plain decoding); returns
    its speed over plain decoding's, from the true costs. ``agrees(p)``: the chance a draft
    at position p agrees; a switch back from plain steps also catches the drafter up
    (``catch_up`` plain steps a token since its last draft, at most 32 tokens);
    ``first_plain`` / ``first_drafted`` scale what the first timed plain stretch and the
    first timed drafted round report (a busy moment); ``slow_drafted`` maps drafted rounds
    (1: the first) to how much slower they report. ``drafted_at`` (a list) gets the
    position of every drafted round that kept a draft. ``round_cost``: ``(base, per_token)``
    plain steps a round drafting k costs ``base + per_token * k``, or a mapping from k to
    what its round costs."""
    text, rng = random.Random(1000 + seed), random.Random(seed)
    match = [text.random() < agrees(p) for p in range(tokens + 64)]
    costs = round_cost if isinstance(round_cost, dict) else None
    base, per_token = round_cost if costs is None else (0.0, 0.0)
    produced, spent, behind, timed_plain, timed_drafted = 0, 0.0, 0, 0, 0
    while produced < tokens:
        k = policy.choose(tokens - produced - 1) if policy is not None else 0
        if k == 0:
            steps = min(policy.stretch if policy is not None else tokens, tokens - produced)
            timed_plain += 1
            if policy is not None:
                seen = rng.lognormvariate(0, noise) * (first_plain if timed_plain == 1 else 1)
                policy.observe(0, 0, seen)
            produced, spent, behind = produced + steps, spent + steps, behind + steps
            continue
        accepted = 0
        while accepted < k and match[produced + accepted]:
            accepted += 1
        cost = (costs[k] if costs else base + per_token * k) + catch_up * min(behind, 32)
        timed_drafted += 1
        stall = first_drafted if timed_drafted == 2 else 1.0  # the first timed one
        stall *= (slow_drafted or {}).get(timed_drafted, 1.0)
        policy.observe(k, accepted, cost * rng.lognormvariate(0, noise) * stall)
        if drafted_at is not None and accepted:
            drafted_at.append(produced)
        produced, spent, behind = produced + accepted + 1, spent + cost, 0
    return produced / spent


def _fixed(k: int):
    class Fixed(DraftLengthPolicy):
        def choose(self, limit):
            return min(k, limit)
    return Fixed(k, adaptive=False)


def _share_of_best_fixed(agrees, seeds=range(24), **options) -> float:
    """The adaptive policy's mean speed over the best fixed length's, request by request."""
    best = max(range(1, 5), key=lambda k: sum(_request(_fixed(k), agrees, seed=s, **options)
                                              for s in seeds))
    return statistics.mean(_request(DraftLengthPolicy(4), agrees, seed=s, **options)
                           / _request(_fixed(best), agrees, seed=s, **options) for s in seeds)


def test_a_drafter_that_pays_from_the_start_reaches_nine_tenths_of_the_best_fixed_length():
    """The issue's default run: the warm-up's rounds, timing plain steps and the first
    probes are all it gives away (0.85 of the best fixed length before, on this model)."""
    assert _share_of_best_fixed(lambda p: AGREES) >= 0.9


def test_a_few_rejected_rounds_at_a_request_s_start_do_not_condemn_a_drafter():
    """The issue's failing run: the first drafts of a continuation mostly miss (here for its
    first 25 tokens), the warm-up keeps one of twelve, and the policy switched drafting off
    for the rest of the request. Before, 7 requests of 24 kept drafting off to their end;
    now at most one in twenty has not drafted again within 80 tokens (a probe into the bad
    stretch spends the budget, and the next comes late: 8 of these 200)."""
    def bad_start(p):
        return 0.1 if p < 25 else AGREES

    assert _share_of_best_fixed(bad_start) >= 0.9
    assert _share_of_best_fixed(lambda p: 0.1 if p < 20 else AGREES, tokens=256) >= 0.9
    condemned = []
    for seed in range(200):
        kept: list[int] = []
        _request(DraftLengthPolicy(4), bad_start, seed=seed, drafted_at=kept)
        if not any(25 < p < 80 for p in kept):
            condemned.append(seed)
    assert len(condemned) <= 10, condemned


#: Where the demo's draft agrees with its target, position by position, along the greedy
#: continuation of eight held-out code prompts (1,000 characters of this project's own
#: modules as they stood on 2026-12-06, not in the demo's training corpus; ``python
#: benchmarks/adaptive_length.py --agreement 160``): a greedy round drafting from a position
#: keeps the run of 1s there.
HELD_OUT_AGREEMENT = (
    "0100111110110111101101101111111011111011111110111101111111101111101111011110111111111111"
    "111111010110111111101011111111111001011111111111111101111011111111011111",
    "0111111001110110011101010101111111111111111011111011101111111101111111111011110111111111"
    "111111111111111111111011111111111111111111111111111111111111111111111111",
    "1110011001111111111111110100111111111111111111110111111111111111111111110111111111111111"
    "111111110111111111111111111111110111111111111111111111111111111111111111",
    "0111011110100111010100011011010110110101101100111110111110111111111011111011111111101111"
    "101111111111111110111111111111111011111111111111101111111111111110111111",
    "0010100111010111111110111111111111110101111111111111111111111111111111111111111111111111"
    "111111111111111111111111111111111111111111111111111111111111111111111111",
    "1001111001101101110000110011111011111111101111111110111111101110111110101111111111111111"
    "111111011111111111111111011101111101111111111111111111111110111111111111",
    "0101111111111111111111111111110111111111111111111111111111111011111111111111111111111111"
    "111101111111111111111111111111111111111111111111111111111111111111111111",
    "1101111011101111110110111011111110011101101111111011111111101011010000111111111111111111"
    "111011011111111111101110110111111101111111110111111011111111111111111111",
)
#: The same pair's round on the 2-core CPU, from the same runs' policy traces: plain steps
#: ~22 ms, one drafted token ~26 ms a round, four ~41 ms.
DEMO_CPU_ROUND = (0.95, 0.23)
#: The same rounds length by length, each the median of a length's timed rounds over its
#: request's timed plain step (docs/bench-data/2026-12-06-epyc-adaptive-length-0936.json and
#: -recalled-1010.json, 8-372 rounds a length): not a line. Two and three drafts cost alike
#: (the target's forward over three tokens or four), four cost a step more.
DEMO_CPU_STEPS = {1: 1.1, 2: 1.6, 3: 1.6, 4: 1.95}


def test_one_request_per_process_on_held_out_code_reaches_the_best_fixed_length_closely():
    """What ``foretell run`` gets: a fresh policy (one request per process) of 96 tokens on
    the demo pair's real agreement with held-out code, against the best fixed length for
    each prompt. A fresh policy pays for its warm-up, for timing plain steps twice (once
    after the warm-up and again eight rounds on, in case the first stretch met a slow
    moment) and for probing other lengths. Timed from stretches of four steps, three, then
    two (each step after the first timed, the last up to the next round's start): 0.918,
    0.942, 0.952 of the best fixed length (0.888, 0.923, 0.933 with the times swinging 30%),
    every case where drafting cannot pay within 0.005 (docs/decisions.md, item 16)."""
    for noise, floor in ((0.1, 0.947), (0.3, 0.928)):
        shares = [_share_of_best_fixed(lambda p, text=text: float(text[p] == "1"), range(12),
                                       tokens=96, round_cost=DEMO_CPU_ROUND, noise=noise)
                  for text in HELD_OUT_AGREEMENT]
        assert statistics.mean(shares) >= floor, (noise, shares)


def _held_out(i: int):
    return lambda p, text=HELD_OUT_AGREEMENT[i % 8]: float(text[p % len(text)] == "1")


def test_on_the_cpus_measured_costs_a_kept_policy_finds_the_length_a_line_misses():
    """On the CPU's measured round costs fixed k = 3 is the best length for seven of the eight
    held-out prompts (k = 4 at 0.90-0.99 of it), which a line through the plain step and the
    warm-up's k = 4 cannot show (it puts k = 3 at 1.71 plain steps, a tie with k = 4). A
    policy kept across requests times k = 3 in its probes and drafts it: 0.975 of the best
    fixed length (0.946 while a length timed three times still took the line's estimate). A
    fresh request of 96 tokens pays for timing plain steps, its warm-up and the shape it
    cannot learn in 30 rounds: 0.91 (docs/decisions.md, item 16)."""
    fresh, kept = [], []
    for i in range(8):
        def speed(policy, seed, i=i):
            return _request(policy, _held_out(i), 96, DEMO_CPU_STEPS, seed=seed)
        best = max(range(1, 5), key=lambda k: sum(speed(_fixed(k), s) for s in range(12)))
        for s in range(12):
            policy = DraftLengthPolicy(4)
            for j in range(1, 4):  # three earlier requests on other prompts
                _request(policy, _held_out(i + j), 96, DEMO_CPU_STEPS, seed=500 + 10 * s + j)
            kept.append(speed(policy, s) / speed(_fixed(best), s))
            fresh.append(speed(DraftLengthPolicy(4), s) / speed(_fixed(best), s))
    assert statistics.mean(kept) >= 0.96, statistics.mean(kept)
    assert statistics.mean(fresh) >= 0.89, statistics.mean(fresh)


def test_no_decision_hinges_on_one_noisy_time():
    """The first timed drafted round stalled tenfold: drafting still pays its way. (The
    first plain stretch timed in a slow moment, with a drafter that cannot pay:
    test_where_drafting_cannot_pay_a_request_keeps_at_least_95_percent_of_plain.)"""
    assert _share_of_best_fixed(lambda p: AGREES, first_drafted=10.0) >= 0.9


def test_a_burst_over_the_warm_up_does_not_switch_a_paying_drafter_off():
    """Measured on the busy 2-core CPU: another process's burst made the warm-up's two timed
    rounds read 324 and 665 ms against ~45, the plain steps timed next read 42 ms, and the
    request decoded its other 90 tokens plainly (0.31x the fixed length). Those two rounds
    follow each other, so they are one moment's; the length is timed once more, from plain
    steps, before its cost switches drafting off. The pair paying ~1.6x plain from the
    start, both timed warm-up rounds eight times slow: 1.04x plain before, ~1.45x now."""
    def speed(seed, slow):
        return _request(DraftLengthPolicy(4), lambda p: AGREES, 96, DEMO_CPU_ROUND, seed=seed,
                        slow_drafted={2: slow, 3: slow})

    assert statistics.mean(speed(s, 8.0) for s in range(24)) >= 1.35
    assert statistics.mean(speed(s, 3.0) for s in range(24)) >= 1.35


def _plain_share(agrees, round_cost, tokens=256, seeds=range(24), draft_cost=None,
                 **options) -> float:
    return statistics.mean(_request(DraftLengthPolicy(4, draft_cost=draft_cost), agrees, tokens,
                                    round_cost, seed=s, **options) for s in seeds)


def test_where_drafting_cannot_pay_a_request_keeps_at_least_95_percent_of_plain():
    """Warm-up and budgeted probes included, over a whole request of 96 tokens (the issue's)
    or 256: a drafter that never agrees (the CPU's costs, as outside testing and the demo
    pair's traces measured them, and length by length), prompt lookup that finds nothing (a
    failed round costs a longer verify), and the demo draft on a GPU (0.72-0.76x plain at
    any fixed length: 68% agreement, a round costing 1.8 + 0.3 k plain steps). At 96 tokens
    a never-agreeing drafter ran 0.937-0.946x plain and failed lookup 0.949x while a
    warm-up that kept nothing was not charged to the exploring budget (now 0.957-0.960x).
    Self-drafting: test_a_drafter_declared_as_costly_as_the_target_skips_the_warm_up."""
    for tokens in (96, 256):
        for never in (CPU_ROUND, DEMO_CPU_ROUND, DEMO_CPU_STEPS):
            assert _plain_share(lambda p: 0.0, never, tokens) >= 0.95, (tokens, never)
        assert _plain_share(lambda p: 0.0, (1.3, 0.02), tokens) >= 0.95, tokens
        assert _plain_share(lambda p: 0.68, (1.8, 0.3), tokens) >= 0.95, tokens


def test_a_warm_up_that_kept_nothing_counts_against_the_exploring_budget():
    """The warm-up is the price of trying a drafter, outside the budget, while it kept any
    draft (a continuation's first drafts may miss); one that kept none was exploring that
    found nothing, so the probes it would have bought next wait for the budget to grow."""
    def after_warm_up(kept: int) -> DraftLengthPolicy:
        policy = DraftLengthPolicy(4)
        for accepted in (0, 0, kept):
            assert policy.choose(100) == 4
            policy.observe(4, accepted, 0.019)  # 1.9 plain steps
        assert policy.choose(100) == 0
        policy.observe(0, 0, 0.010)
        return policy

    assert after_warm_up(kept=1).exploring_allowed()
    nothing = after_warm_up(kept=0)
    assert not nothing.exploring_allowed()
    assert nothing.choose(100) == 0


def test_a_plain_stretch_timed_in_a_busy_moment_misleads_the_policy_for_a_few_rounds_only():
    """The first plain stretch timed at twice what plain steps cost: drafting looks like a
    gain until plain steps are timed again, eight rounds on, and the request keeps most of
    plain decoding's speed (0.91x for the GPU draft when they were timed again only after
    sixteen rounds, with the other probes)."""
    assert _plain_share(lambda p: 0.0, CPU_ROUND, first_plain=2.0) >= 0.93
    assert _plain_share(lambda p: 0.68, (1.8, 0.3), first_plain=2.0) >= 0.93


def test_a_lone_rows_two_step_plain_stretch_times_a_plain_step(engines, model_dirs, registry):
    """The policy times plain steps in stretches of TIMING_STRETCH; the scheduler times a lone
    row's stretch by the gaps between its steps' starts from the second on, its last gap
    ending at the next round's start (the last step waited there for the one before), so
    a stretch of two steps tells the policy one plain step's time (it told nothing while the
    stretch's own starts were its only gaps)."""
    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=3)
    policy, told, answers = speculator.policy, [], iter([3, 3, 0, 3, 0, 0, 3])

    def choose(limit):
        k = min(next(answers, 3), limit)
        policy.stretch = 2
        return k

    policy.choose = choose
    policy.observe = lambda drafted, accepted, seconds, **_: told.append((drafted, seconds))
    scheduler = Scheduler(engine)
    list(scheduler.submit([11, 57, 300, 4, 89, 120, 7, 250], max_tokens=40, ignore_eos=True,
                          speculate=speculator))
    scheduler.close()
    plain = [seconds for drafted, seconds in told if drafted == 0]
    assert len(plain) == 3 and all(seconds > 0 for seconds in plain)
    # Each stretch's timing came before the round after it was chosen.
    assert [d for d, _ in told][:6] == [3, 3, 0, 3, 0, 0]


#: The target drafting for itself on the CPU: a round drafting k costs 2 + k plain steps
#: (the demo's traces), or what the 2-core Xeon measured length by length; 95% kept.
SELF_ROUND = (2.0, 1.0)
XEON_SELF_STEPS = {1: 2.3, 2: 3.9, 3: 5.8, 4: 7.8}


def test_a_drafter_declared_as_costly_as_the_target_skips_the_warm_up():
    """A drafter declaring that a drafted token costs a target step (the two-model drafter
    with the target as its draft: foretell.spec.cost_prior) cannot pay at any length, so the
    policy skips the blind warm-up (three rounds of 4 that kept their drafts and lost ~4
    plain steps before a plain step was timed: 0.934x plain at 96 tokens, 0.861x on the
    Xeon's costs) and only probes k = 1 once plain steps are timed, then within the budget:
    0.968x / 0.960x now (docs/decisions.md, item 16, the cost prior)."""
    for tokens in (96, 256):
        for cost in (SELF_ROUND, XEON_SELF_STEPS):
            assert _plain_share(lambda p: 0.95, cost, tokens, draft_cost=1.0) >= 0.95, (tokens, cost)
    assert _plain_share(lambda p: 0.95, SELF_ROUND, 96, draft_cost=1.0, noise=0.3) >= 0.95
    policy = DraftLengthPolicy(4, draft_cost=1.0)
    assert policy.choose(100) == 0 and policy.stretch < PLAIN_STRETCH  # plain steps timed first
    policy.observe(0, 0, 0.010)
    assert policy.choose(100) == 1  # the cheapest probe, a switch back (untimed) ...
    policy.observe(1, 1, 0.030)
    assert policy.choose(100) == 1  # ... and its timed round
    policy.observe(1, 1, 0.030)
    assert policy.measured() == {0: 0.010, 1: 0.030}


def test_a_timed_round_overrules_a_declared_cost():
    """A declaration is an estimate (weights' bytes on a device that runs the draft otherwise):
    a drafter that pays, wrongly declared as costly as the target, is probed as soon as plain
    steps are timed and drafts on its timed rounds' evidence, within a few percent of the
    undeclared policy (probing first at round 16 instead: 0.54x of it in 96 tokens)."""
    for tokens in (96, 256):
        declared = _plain_share(lambda p: AGREES, CPU_ROUND, tokens, draft_cost=1.0)
        assert declared >= 0.97 * _plain_share(lambda p: AGREES, CPU_ROUND, tokens), tokens


def test_a_declared_cost_under_one_step_changes_nothing():
    """Below one step a declaration is a bound that says drafting might pay: what the warm-up
    finds out anyway, so a cheap drafter's requests run exactly as undeclared."""
    for agrees, cost in ((lambda p: AGREES, CPU_ROUND), (_held_out(0), DEMO_CPU_STEPS),
                         (lambda p: 0.0, DEMO_CPU_ROUND), (lambda p: 0.68, (1.8, 0.3))):
        for draft_cost in (0.0, 0.19, 0.99):
            assert [_request(DraftLengthPolicy(4, draft_cost=draft_cost), agrees, 96, cost, seed=s)
                    for s in range(6)] == [_request(DraftLengthPolicy(4), agrees, 96, cost, seed=s)
                                           for s in range(6)]


def test_a_recalled_state_wins_over_a_declared_cost():
    """A state recalled from another process holds timings of this pairing on this machine:
    a declared cost (an estimate) then changes nothing."""
    teacher = DraftLengthPolicy(4)
    _request(teacher, lambda p: AGREES, 256, CPU_ROUND, seed=99)
    state = teacher.state()

    def recalled(draft_cost):
        policy = DraftLengthPolicy(4, draft_cost=draft_cost)
        policy.recall(state)
        return policy

    for agrees, cost in ((lambda p: AGREES, CPU_ROUND), (lambda p: 0.95, SELF_ROUND)):
        assert [_request(recalled(1.0), agrees, 96, cost, seed=s) for s in range(6)] == [
            _request(recalled(None), agrees, 96, cost, seed=s) for s in range(6)]
