"""The batch's draft-length policy decides from what it measured: acceptance per row (with a
prior, so a few early rejections do not condemn a drafter) and cost per batch shape (lower
quartile, so one noisy step moves nothing); plain decoding wins where drafts cannot pay, a shape not
measured is estimated rather than probed, and a shape not measured lately is tried again,
seldom enough that the looks cost little."""

from __future__ import annotations

import pytest

from foretell.spec.batch_policy import (
    LOOK_SHARE,
    REPROBE,
    BatchDraftPolicy,
    batch_tokens,
    expected_tokens,
)


def run(policy: BatchDraftPolicy, caps, rates, cost, steps: int) -> list[int]:
    """``steps`` decisions against a machine whose step over ``(rows, width)`` costs
    ``cost(rows, width)``; the widths chosen."""
    chosen = []
    for _ in range(steps):
        lengths = policy.choose(caps, rates)
        width = max(lengths)
        policy.observe(len(caps), width, cost(len(caps), width))
        chosen.append(width)
    return chosen


def test_expected_tokens_counts_the_target_token_and_each_kept_draft():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == 1.75


def test_a_steps_tokens_are_each_plain_rows_one_and_each_drafting_rows_expected():
    assert batch_tokens(4, 0, 0.9, 3) == 4.0
    assert batch_tokens(4, 2, 0.5, 2) == 2 * 1.0 + 2 * expected_tokens(0.5, 2)


def test_drafting_that_pays_is_kept_after_the_probes():
    policy = BatchDraftPolicy()
    # Verifying 4 drafts costs 1.3 plain steps; rows keep 80% of drafts: 3.4 tokens a step.
    chosen = run(policy, [4, 4], [0.8, 0.8], lambda rows, w: 1.0 + 0.075 * w, 40)
    assert chosen[-20:].count(4) >= 19


def test_drafting_that_cannot_pay_goes_off_at_a_large_batch():
    policy = BatchDraftPolicy()
    # A large batch: verifying 4 drafts per row costs 3x a plain step; 40% acceptance.
    chosen = run(policy, [4] * 16, [0.4] * 16, lambda rows, w: 1.0 + 0.5 * w, 40)
    assert chosen[-20:].count(0) >= 19


def test_early_rejections_move_a_rows_rate_only_partway():
    rate = BatchDraftPolicy().rate(tried=4, kept=0)  # four rejections in a row
    assert 0.3 < rate < 0.6
    assert BatchDraftPolicy().rate(tried=400, kept=0) < 0.02


def test_a_rows_rate_is_the_chance_a_draft_is_kept_after_the_ones_before_it():
    """The verifier stops at the first rejection, so a round of ``k`` drafts that kept ``a``
    tried ``a + 1`` positions: counted so, a row whose drafts are each kept with chance 0.75
    reads 0.75, and the step's expected tokens (what the choice weighs) come out as the rows
    make them. Counted as ``a`` of ``k`` it read 0.64 and drafting that paid 1.3x plain
    decoding was turned off."""
    import random

    rng = random.Random(0)
    policy, row, kept_total, rounds = BatchDraftPolicy(), object(), 0, 4000
    for _ in range(rounds):
        kept = 0
        while kept < 2 and rng.random() < 0.75:
            kept += 1
        kept_total += kept
        policy.learn("two-model", 2, kept, row)
    assert abs(policy.prior("two-model") - 0.75) < 0.05
    made = 1 + kept_total / rounds
    assert abs(expected_tokens(policy.prior("two-model"), 2) - made) < 0.1
    # Two drafts over two rows cost 1.8 plain steps and return 2.31 tokens a row: 1.28x
    # plain decoding, which the policy keeps (read as 0.66, they promised 1.16x).
    rate = policy.prior("two-model")
    chosen = run(policy, [2, 2], [rate, rate], lambda rows, w: 1.0 + 0.4 * w, 40)
    assert chosen[-20:].count(2) >= 19


def test_a_new_row_starts_from_its_drafters_record_not_from_zero():
    policy = BatchDraftPolicy()
    fresh = policy.rate(0, 0, "two-model")
    for _ in range(50):
        policy.learn("two-model", 4, 4)  # earlier rows kept every draft
        policy.learn("ngram", 4, 0)  # another drafter's rows kept none
    assert policy.rate(0, 0, "two-model") > 0.9 > fresh
    assert policy.rate(0, 0, "ngram") < 0.1
    assert policy.rate(0, 0, "mtp") == fresh  # no record yet


def test_one_noisy_step_does_not_flip_the_choice():
    policy = BatchDraftPolicy()
    cost = lambda rows, w: 1.0 + 0.075 * w  # noqa: E731
    run(policy, [4, 4], [0.8, 0.8], cost, 30)
    policy.observe(2, 4, 50.0)  # a one-off stall on the drafted shape
    assert max(policy.choose([4, 4], [0.8, 0.8])) == 4


def test_a_width_not_taken_lately_is_measured_again():
    policy = BatchDraftPolicy()
    # Drafting does not pay at this acceptance, but it could were it higher.
    chosen = run(policy, [4], [0.1], lambda rows, w: 1.0 + 0.1 * w, 2 * REPROBE + 10)
    # Mostly plain, but the drafted widths come back for a look every REPROBE steps.
    assert chosen.count(0) > 0.9 * len(chosen)
    assert sum(1 for w in chosen[20:] if w) >= 2


def test_a_drafted_step_after_plain_ones_is_drafted_again_and_only_the_second_timed():
    policy = BatchDraftPolicy()
    for _ in range(3):
        policy.observe(4, 0, 1.0)  # plain steps
    policy.observe(4, 4, 9.0)  # the switch back: the drafter caught up on the plain tokens
    assert policy.cost(4, 4) is None
    assert max(policy.choose([4] * 4, [0.8] * 4)) == 4  # drafted again, to be timed
    policy.observe(4, 4, 1.3)
    assert policy.cost(4, 4) == 1.3


def test_a_row_count_never_measured_borrows_the_nearest_ones_relative_cost():
    policy = BatchDraftPolicy()
    policy.observe(4, 0, 1.0)
    policy.observe(4, 4, 1.0)  # a switch back, untimed
    policy.observe(4, 4, 1.5)
    policy.observe(3, 0, 0.8)
    policy.observe(3, 0, 0.8)  # plain decoding timed once is timed again before it weighs
    assert policy.cost(3, 4) == 0.8 * 1.5
    assert policy.cost(3, 2) == 0.8 * 1.25  # nobody measured width 2: half width 4's share
    assert policy.cost(5, 4) == 1.5  # nor plain decoding over 5 rows: 4 rows' plain step
    policy.observe(4, 2, 1.0)  # (a switch back, untimed)
    policy.observe(4, 2, 1.2)
    # So a row leaving does not set off probes: every width is judged at once, and the
    # widest pays most at this acceptance.
    assert [max(policy.choose([4] * 3, [0.9] * 3)) for _ in range(5)] == [4] * 5


def test_no_wider_width_is_tried_once_a_narrower_one_cannot_pay_and_it_is_retried_rarely():
    from foretell.spec.batch_policy import HOPELESS_SLOWER

    policy = BatchDraftPolicy()
    # A large batch: drafting 2 costs 3x a plain step; rows keep half their drafts.
    chosen = run(policy, [4] * 16, [0.5] * 16, lambda rows, w: 1.0 + w, 2000)
    assert 4 not in chosen  # width 2 could not pay even at 0.65: 4 is never measured
    drafted = [i for i, w in enumerate(chosen) if w]
    # After plain decoding's two timings, width 2's first look is two steps (the switch
    # back untimed), then it waits HOPELESS_SLOWER times longer than a width that might pay.
    assert drafted[:2] == [2, 3]
    assert len(drafted) > 2
    assert all(b - a >= HOPELESS_SLOWER * REPROBE - 2 for a, b in zip(drafted[1::2],
                                                                    drafted[2::2]))


def test_rows_nearing_their_end_bring_no_new_width_to_measure():
    policy = BatchDraftPolicy()
    run(policy, [4] * 8, [0.5] * 8, lambda rows, w: 1.0 + w, 12)  # 2 and 4 can't pay here
    # Rows with one or two tokens left cap their drafts at 1: width 1 was never measured,
    # but the widths come from the drafters' own length, so nothing new is probed.
    for _ in range(5):
        assert policy.choose([1] * 8, [0.5] * 8, top=4) == [0] * 8
        policy.observe(8, 0, 1.0)


def test_a_width_that_keeps_losing_is_looked_at_ever_less_often():
    from foretell.spec.batch_policy import MAX_BACKOFF

    policy = BatchDraftPolicy()
    # Drafting loses here (not hopeless: one row keeps 60%): each look confirms plain
    # decoding.
    rates = [0.6, 0.05, 0.05, 0.05]
    chosen = run(policy, [4] * 4, rates, lambda rows, w: 1.0 + 0.3 * w, 40 * REPROBE)
    looks = [i for i, w in enumerate(chosen) if w and not chosen[i - 1]]  # a look's start
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    # A look at width 2 (1.6 plain steps) yields the tokens of `worth` of its time in plain
    # steps and loses the rest of its two steps: it comes every lost / LOOK_SHARE steps at
    # most, then half as often after each look that lost.
    mean = sum(rates) / len(rates)
    worth = (4 + 4 * (expected_tokens(mean, 2) - 1)) / 1.6 / 4
    interval = max(REPROBE, 2 * 1.6 * (1 - worth) / LOOK_SHARE)
    assert interval > REPROBE
    assert gaps[0] >= interval - 2
    assert gaps[-1] >= MAX_BACKOFF * interval // 2 > gaps[0]
    assert max(gaps) <= MAX_BACKOFF * interval + 4
    # The looks cost little over a long run: nearly every step is plain.
    assert chosen.count(0) > 0.97 * len(chosen)


def test_a_width_promising_nearly_what_plain_does_is_looked_at_every_reprobe_steps():
    """A look loses its steps' time less the time plain decoding takes to yield the tokens
    they are expected to: at 1.185x plain's rate (under the bar to start drafting) width 1
    loses nothing by that count and is looked at every REPROBE steps, where counting its
    whole extra time (0.35 of a step, twice) would space its looks 70 steps apart."""
    policy = BatchDraftPolicy()
    chosen = run(policy, [3, 3], [0.6, 0.6], lambda rows, w: 1.0 + 0.35 * w, 10 * REPROBE)
    looks = [i for i, w in enumerate(chosen) if w and not chosen[i - 1]]
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert chosen[-4 * REPROBE:].count(0) > 0.9 * 4 * REPROBE  # plain stays the choice
    assert len(gaps) >= 6 and max(gaps) <= REPROBE + 2


def test_a_batch_whose_drafters_record_reads_low_gets_back_to_drafting():
    """A drafter's record read low (kept from requests' starts, say) leaves new rows'
    estimates just under the bar; looks at the widths that nearly pay bring their evidence
    in, so batch after batch of 64-token requests drafts as it should (at 82% kept, on a
    CPU-like cost, 1.3x plain decoding) rather than waiting for a lucky look."""
    import random

    cost = lambda w: 1.0 + 0.33 * w + 0.04 * w * w  # noqa: E731 - the CPU's, B = 2

    def speedup(seed: int) -> float:
        rng = random.Random(seed)
        policy = BatchDraftPolicy()
        for _ in range(40):  # the record: 40 rounds of 1 draft, 55% kept
            policy.learn("two-model", 1, int(rng.random() < 0.55))
        tokens = seconds = 0.0
        for request in range(8):
            rows = [(request, 0), (request, 1)]
            policy.retain(rows)
            for _ in range(64):
                lengths = policy.choose([3, 3], [policy.row_rate(r, "two-model") for r in rows])
                policy.observe(2, max(lengths), cost(max(lengths)))
                seconds += cost(max(lengths))
                for row, k in zip(rows, lengths):
                    kept = 0
                    while kept < k and rng.random() < 0.82:  # what the rows really keep
                        kept += 1
                    if k:
                        policy.learn("two-model", k, kept, row)
                    tokens += 1 + kept
        return tokens / seconds / 2.0

    assert min(speedup(seed) for seed in range(30)) > 1.15


def test_a_look_that_must_first_feed_rows_drafters_comes_as_much_less_often():
    """Rows that joined while the batch decoded plainly have drafters never fed: a look at
    drafting over them also pays for feeding them, so it comes that much less often."""
    cost = lambda rows, w: 1.0 + 0.3 * w  # noqa: E731 - drafting loses a little here

    def looks(policy, dormant):
        chosen = []
        for _ in range(30 * REPROBE):
            width = max(policy.choose([4] * 16, [0.3] * 16, dormant=dormant))
            policy.observe(16, width, cost(16, width))
            chosen.append(width)
        return [i for i, w in enumerate(chosen) if w and not chosen[i - 1]]

    fed = BatchDraftPolicy()
    unfed = BatchDraftPolicy()
    unfed.observe(16, 0, 1.0)
    unfed.woke(16, 16, 2, 1.0 + 16 * 2.0)  # feeding a row's drafter cost two plain steps
    every_row_fed, none_fed = looks(fed, 0), looks(unfed, 16)
    assert len(every_row_fed) >= 5
    # Past the first looks (nothing measured yet), one over 16 unfed rows loses 32 steps
    # more: due every 3,200 steps or more, none in these 1,440.
    assert [i for i in none_fed if i > REPROBE] == []
    assert [i for i in every_row_fed if i > REPROBE]


def test_feeding_costs_are_what_a_step_took_beyond_the_shape():
    policy = BatchDraftPolicy()
    policy.woke(4, 8, 2, 1.4)  # no cost known for the shape: nothing to learn from
    assert policy._wake_cost == 0.0
    for width in (0, 2, 2):  # (the step switching to drafting is not timed)
        policy.observe(8, width, 1.0)
    policy.woke(4, 8, 2, 1.4)
    policy.woke(2, 8, 2, 0.9)  # a step faster than its estimate: nothing, not a credit
    assert policy._wake_cost == pytest.approx(0.05)


def test_rows_without_a_drafter_never_draft():
    policy = BatchDraftPolicy()
    lengths = policy.choose([4, 0, 4], [0.9, None, 0.9])
    assert lengths[1] == 0


def test_a_row_running_alone_follows_its_speculators_length_policy(engines, model_dirs,
                                                                    registry):
    """Alone in the batch, a request is drafted for as it is decoding by itself: its
    speculator's policy chooses each round's length and learns each round's outcome, and
    once it says 0 the row decodes a plain stretch of the length it asked for and the policy
    learns that stretch's step time."""
    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator
    from foretell.spec.policy import PLAIN_STRETCH

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=3)
    policy = speculator.policy
    asked, told = [], []
    answers = iter([3, 2, 0, 3, 0])

    def choose(limit):
        asked.append(limit)
        return min(next(answers, 0), limit)

    policy.choose = choose
    policy.observe = lambda drafted, accepted, seconds, **_: told.append((drafted, accepted))
    scheduler = Scheduler(engine)
    prompt = [11, 57, 300, 4, 89, 120, 7, 250]
    events = list(scheduler.submit(prompt, max_tokens=60, ignore_eos=True,
                                   speculate=speculator))
    scheduler.close()
    plain = list(engine.generate(prompt, max_tokens=60, ignore_eos=True, speculate=False))
    assert [t for e in events[:-1] for t in e.tokens] == [t for e in plain[:-1] for t in e.tokens]
    drafted = [d for d, _ in told if d]
    assert drafted == [3, 2, 3]  # every drafted round reported, at the length chosen
    # After each 0 a whole stretch runs before the policy is asked again, and it hears the
    # stretch's step time once.
    assert [d for d, _ in told].count(0) >= 2
    stretch_then_asked = len(asked)
    tokens = sum(len(e.tokens) for e in events[:-1])
    assert stretch_then_asked <= 5 + tokens // PLAIN_STRETCH + 1
    assert events[-1].speculation["drafted"] == 8


def test_a_wider_width_the_narrower_ones_cost_says_cannot_win_is_never_probed():
    """On a CPU a step's cost grows with its width: at a large batch, once width 2 is
    measured losing, width 4 (estimated from it) is not probed blind, so a request's
    first steps do not pay for a width that was never going to be chosen."""
    policy = BatchDraftPolicy()
    # Width 2 costs 2.5 plain steps (4 would cost 4); rows keep 70% of their drafts, so
    # width 2 makes 2.19 tokens a row per step and width 4 2.77: neither pays.
    chosen = run(policy, [4] * 8, [0.7] * 8, lambda rows, w: 1.0 + 0.75 * w, 64)
    assert 4 not in chosen
    assert sum(1 for w in chosen if w) <= 2  # width 2's look: the switch, then one timed


def test_an_estimated_width_that_would_win_is_measured_and_kept():
    policy = BatchDraftPolicy()
    # Verifying is cheap here (width 4 costs 1.3 plain steps) and rows keep 80% of their
    # drafts: plain decoding is timed twice, width 2 measured, width 4 estimated from it to
    # win, then measured winning.
    chosen = run(policy, [4, 4], [0.8, 0.8], lambda rows, w: 1.0 + 0.075 * w, 20)
    assert chosen[:5] == [0, 0, 2, 2, 4]
    assert chosen[5:] == [4] * 15


def test_drafting_once_chosen_goes_on_while_it_still_pays():
    """A batch that stopped drafting learns nothing more of its rows' acceptance until a
    look: drafting chosen goes on while it promises HOLD_GAIN over plain decoding (a few
    rejections in a row dip a row's estimate under CLEAR_GAIN), and stops where it does not."""
    from foretell.spec.batch_policy import CLEAR_GAIN, HOLD_GAIN

    cost = lambda rows, w: 1.0 + 0.3 * w  # noqa: E731 - width 2 costs 1.6 plain steps
    policy = BatchDraftPolicy()
    assert run(policy, [2, 2], [0.8, 0.8], cost, 10)[-5:] == [2] * 5  # 1.53x: drafted
    # Estimates dip to a 1.12x promise: under the bar to start, over the bar to stop.
    dipped = next(r / 100 for r in range(80, 0, -1)
                  if expected_tokens(r / 100, 2) / 1.6 < 1 + (CLEAR_GAIN + HOLD_GAIN) / 2)
    assert expected_tokens(dipped, 2) / 1.6 > 1 + HOLD_GAIN
    assert all(run(policy, [2, 2], [dipped, dipped], cost, 10))  # width 2 or 1 (1.17x)
    fresh = BatchDraftPolicy()
    run(fresh, [2, 2], [0.0, 0.0], cost, 4)  # plain and width 2 measured, plain chosen
    assert run(fresh, [2, 2], [dipped, dipped], cost, 10) == [0] * 10
    # Where drafting stops paying (under 1.0x at either width) it stops.
    low = next(r / 100 for r in range(80, 0, -1)
               if max(expected_tokens(r / 100, w) / cost(2, w) for w in (1, 2)) < 1.0)
    assert run(policy, [2, 2], [low, low], cost, 10)[-5:] == [0] * 5


def test_drafting_must_clearly_beat_plain_decoding():
    """A width that promises only a few percent more than plain decoding is not drafted:
    switching and rows drifting apart cost what the per-step estimate leaves out."""
    from foretell.spec.batch_policy import CLEAR_GAIN

    policy = BatchDraftPolicy()
    gain = 1.0 + CLEAR_GAIN / 2
    # Width 2 yields 1 + 0.5 + 0.25 tokens a row for 1.75 / gain plain steps (and width 4,
    # costing as much again per draft, less).
    share = (1.75 / gain - 1.0) / 2
    chosen = run(policy, [4] * 8, [0.5] * 8, lambda rows, w: 1.0 + share * w, 40)
    assert chosen[3:].count(0) >= 36


def test_a_step_the_caller_could_not_time_is_taken_again_and_not_counted():
    policy = BatchDraftPolicy()
    policy.observe(4, 0, None)  # e.g. the first pipelined step, which waited for nothing
    assert policy.cost(4, 0) is None
    assert max(policy.choose([4] * 4, [0.8] * 4)) == 0  # the same shape once more, timed
    policy.observe(4, 0, 1.0)
    assert policy.cost(4, 0) == 1.0


def test_a_plain_choice_no_row_could_draft_does_not_stand():
    """At a batch's first step no row can draft (no first token yet): plain decoding is
    chosen, and that choice does not stand for the steps after it, which may draft."""
    policy = BatchDraftPolicy()
    run(policy, [4, 4], [0.8, 0.8], lambda rows, w: 1.0 + 0.075 * w, 3 * REPROBE)
    policy.observe(2, 0, 1.0)
    assert max(policy.choose(lambda: [0, 0], [0.8, 0.8], top=4)) == 0
    policy.observe(2, 0, 1.0)
    assert max(policy.choose(lambda: [4, 4], [0.8, 0.8], top=4)) == 4


def test_plain_decoding_is_timed_again_while_drafting_pays():
    """Every choice weighs against a plain step's cost, and a host's speed drifts: plain
    decoding is looked at every REPROBE steps, without backing off."""
    policy = BatchDraftPolicy()
    chosen = run(policy, [4, 4], [0.8, 0.8], lambda rows, w: 1.0 + 0.075 * w, 10 * REPROBE)
    looks = [i for i, w in enumerate(chosen) if not w and chosen[i - 1]]
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert len(looks) >= 8
    assert max(gaps) <= REPROBE + 4


def test_a_rows_rate_follows_its_recent_drafts():
    """Acceptance moves within a request (a continuation's start is the hardest to guess):
    a row that rejected its first drafts and keeps its recent ones is estimated from them."""
    policy = BatchDraftPolicy()
    row = object()
    for _ in range(5):
        policy.learn("two-model", 2, 0, row)
    for _ in range(10):
        policy.learn("two-model", 2, 2, row)
    assert policy.row_rate(row, "two-model") > 0.8
    policy.retain([])  # the row left: its evidence goes
    assert policy.row_rate(row, "two-model") == policy.rate(0, 0, "two-model")


def test_rows_finishing_apart_keep_drafting_at_each_new_row_count():
    """A batch whose rows finish at different steps meets a new row count nearly every
    step at its end; where drafting pays, each is drafted at once on the estimate, not
    decoded plainly first to measure it."""
    policy = BatchDraftPolicy()
    run(policy, [4] * 8, [0.8] * 8, lambda rows, w: 1.0 + 0.1 * w, 12)
    for rows in (7, 5, 4, 2):
        assert max(policy.choose([4] * rows, [0.8] * rows)) == 4
        policy.observe(rows, 4, None)  # the row set changed: the caller could not time it


def test_a_busy_host_while_decoding_plainly_does_not_make_drafting_look_cheap():
    """Another process slowing the host for a while lengthens the steps timed then; a
    shape's cost is the lower quartile of its timings, so plain decoding timed mostly in a
    busy moment is still weighed at what it costs, against drafts timed in a quiet one."""
    policy = BatchDraftPolicy()
    # Width 2 costs 2.2 plain steps: at 77% acceptance (2.36 tokens a row) it cannot pay.
    chosen = run(policy, [4] * 8, [0.77] * 8, lambda rows, w: 1.0 + 0.6 * w, 12)
    assert chosen[-1] == 0
    for _ in range(6):  # a busy moment: plain steps take twice as long
        policy.choose([4] * 8, [0.77] * 8)
        policy.observe(8, 0, 2.0)
    assert max(policy.choose([4] * 8, [0.77] * 8)) == 0


def test_round_token_variance_is_the_kept_counts():
    """``tokens_variance`` against the distribution itself: ``P(kept = a) = r^a (1 - r)``
    for ``a < k``, ``r^k`` for ``a = k``."""
    from foretell.spec.batch_policy import slowest_of, tokens_variance

    for rate in (0.0, 0.3, 0.75, 1.0):
        for k in (1, 2, 4):
            p = [rate**a * (1 - rate) for a in range(k)] + [rate**k]
            mean = sum(a * q for a, q in enumerate(p))
            var = sum((a - mean) ** 2 * q for a, q in enumerate(p))
            assert abs(tokens_variance(rate, k) - var) < 1e-12
            assert abs(expected_tokens(rate, k) - 1 - mean) < 1e-12
    assert slowest_of(1) == 0.0 and 0.5 < slowest_of(2) < 0.6
    assert 1.4 < slowest_of(8) < 1.45 and slowest_of(32) > slowest_of(16)


def test_a_draining_batch_weighs_the_drift_drafting_adds():
    """Rows drafting keep their drafts unevenly and drift apart; a batch no request will
    refill ends with its slowest row. A width whose per-step estimate clears the bar by a
    little is not drafted over 8 rows with 64 tokens left each, is drafted where finished
    rows are replaced (``draining`` None), and over 2 rows, whose drift is small, still is."""
    from foretell.spec.batch_policy import CLEAR_GAIN, drift_factor, tokens_variance

    rate = 0.75
    gain = 1.0 + CLEAR_GAIN + 0.05  # what width 2 promises per step
    share = (expected_tokens(rate, 2) / gain - 1.0) / 2
    cost = lambda rows, w: 1.0 + share * w  # noqa: E731

    def chosen(rows, draining):
        policy = BatchDraftPolicy()
        widths = []
        for _ in range(30):
            lengths = policy.choose([2] * rows, [rate] * rows, 2, draining)
            width = max(lengths)
            policy.observe(rows, width, cost(rows, width))
            widths.append(width)
        return widths[-10:]

    row = (expected_tokens(rate, 2), tokens_variance(rate, 2), 64)  # width 2, 64 tokens left
    assert drift_factor([row] * 8) > gain / (1.0 + CLEAR_GAIN)
    assert chosen(8, [64] * 8) == [0] * 10
    assert chosen(8, None) == [2] * 10
    assert drift_factor([row] * 2) < gain / (1.0 + CLEAR_GAIN)
    assert chosen(2, [64] * 2) == [2] * 10


def test_the_batch_tells_the_policy_the_tokens_left_only_while_no_request_waits():
    from types import SimpleNamespace

    from foretell.batch_step import BatchStep

    step = BatchStep.__new__(BatchStep)
    step._policy, step._batch, step._groups = BatchDraftPolicy(), [], {}
    told = []
    step._policy.choose = lambda caps, rates, top, draining, dormant: told.append(draining) or caps
    speculator = SimpleNamespace(kind="k", adaptive=True, max_tokens=3)

    class Row:  # hashable, compared by identity, as the scheduler's rows
        def __init__(self, consumed):
            self.speculator, self.max_tokens, self.unread = speculator, 64, True
            self.state = SimpleNamespace(consumed=consumed)

    rows = [Row(10), Row(40)]
    step._waiting, step._prefilling, step._queued = [object()], [], 0
    step._choose_lengths(rows)
    step._waiting, step._queued = [], 1
    step._choose_lengths(rows)
    step._queued = 0
    step._choose_lengths(rows)
    assert told[:2] == [None, None] and told[2]() == [53, 23]


def test_a_plain_choice_never_works_out_the_rows_caps():
    """Caps given as a function are asked for only where a length depends on them: a
    batch whose choice is plain decoding (a large batch of idle drafters, every step)
    skips the per-row work; the probes and looks that draft do ask."""
    policy = BatchDraftPolicy()
    asked = []

    def caps():
        asked.append(True)
        return [2] * 8

    widths = []
    for _ in range(200):
        width = max(policy.choose(caps, [0.3] * 8, 2))
        policy.observe(8, width, 1.0 + 0.8 * width)  # drafting cannot pay
        widths.append(width)
    assert widths.count(0) >= 190
    assert len(asked) == sum(1 for w in widths if w)  # asked only for drafted steps


def test_plain_decoding_timed_once_is_timed_again_before_drafting_is_weighed_against_it():
    """A shape's first step on a GPU may compile its kernels (H100: a plain step over 4
    rows timed 6.4 ms, the next 0.9 ms): plain decoding measured once over a row count is
    measured again before a drafted width is weighed against it, so a one-off never makes
    drafting at 5 ms a step look cheap."""
    policy = BatchDraftPolicy()
    compiling = iter([6.4])

    def cost(rows: int, width: int) -> float:
        return 5.0 if width else next(compiling, 0.9)

    chosen = run(policy, [4] * 4, [0.85] * 4, cost, 12)
    assert chosen[:2] == [0, 0]  # measured, then measured again
    assert chosen[-6:] == [0] * 6  # width 2 (measured once, at 5 ms) lost to 0.9 ms


def test_a_plain_choice_stands_a_few_steps_for_the_same_rows_and_estimates(monkeypatch):
    """A plain choice over unchanged rows and estimates is not worked out again for
    PLAIN_HOLD steps (idle drafter rows' choice cost a host-bound GPU step ~5%): the same
    choices and the same looks as working it out every step, a fraction of the work; new
    estimates end the hold at once."""
    from foretell.spec import batch_policy

    def decide(hold: int, steps: int = 400) -> tuple[list[int], int]:
        monkeypatch.setattr(batch_policy, "PLAIN_HOLD", hold)
        policy = BatchDraftPolicy()
        worked = []
        unbeaten = policy._plain_unbeaten
        monkeypatch.setattr(policy, "_plain_unbeaten",
                            lambda *args: worked.append(1) or unbeaten(*args))
        chosen = []
        for _ in range(steps):  # as the scheduler asks: its drafters' top length given
            width = max(policy.choose([4] * 16, [0.5] * 16, 4))
            policy.observe(16, width, 1.0 + width)
            chosen.append(width)
        return chosen, len(worked)

    held, work_held = decide(batch_policy.PLAIN_HOLD)
    every, work_every = decide(0)
    assert held == every and 2 in held  # looks at width 2 included
    assert work_held < work_every / 3

    policy = BatchDraftPolicy()
    run(policy, [4] * 4, [0.1] * 4, lambda rows, w: 1.0 + 0.05 * w, 8)
    assert max(policy.choose([4] * 4, [0.1] * 4, 4)) == 0
    assert max(policy.choose([4] * 4, [0.95] * 4, 4)) > 0
