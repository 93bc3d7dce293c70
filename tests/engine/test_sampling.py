import math

import mlx.core as mx
import numpy as np
import pytest

from foretell.config import SamplingConfig
from foretell.sampling import (
    RandomKeys,
    Sampler,
    apply_repetition_penalty,
    draw_rows,
    repetition_windows,
)


def kept(scores: mx.array) -> set[int]:
    return set(np.flatnonzero(np.isfinite(np.array(scores[0].astype(mx.float32)))).tolist())


def logits_of(probs: list[float]) -> mx.array:
    return mx.log(mx.array([probs], dtype=mx.float32))


def test_greedy_is_exactly_the_argmax_of_the_logits():
    logits = mx.random.normal((16, 1000), key=mx.random.key(0))
    chosen = Sampler(SamplingConfig(temp=0.0))(logits, None, None)
    assert chosen.dtype == mx.int32
    assert np.array(chosen).tolist() == np.argmax(np.array(logits), axis=-1).tolist()


def test_a_batch_draws_each_row_as_its_own_sampler_draws_it_alone():
    """Greedy rows of different settings are drawn together (their settings change nothing
    greedy reads); sampled rows by their own settings and the key of their position."""
    logits = mx.random.normal((5, 300), key=mx.random.key(3)) * 4
    configs = [SamplingConfig(temp=0.0), SamplingConfig(temp=0.8, top_k=20, seed=1),
               SamplingConfig(temp=0.0, top_k=5, min_p=0.2), SamplingConfig(temp=0.0),
               SamplingConfig(temp=1.0, top_p=0.9, seed=2)]
    rows = [(sampler, sampler.keys(), 7 + b)
            for b, sampler in enumerate(Sampler(c) for c in configs)]
    drawn = np.array(draw_rows(logits, rows)).tolist()
    alone = [np.array(sampler(logits[b : b + 1], None, None if keys is None
                              else keys.rows(position))).tolist()[0]
             for b, (sampler, keys, position) in enumerate(rows)]
    assert drawn == alone


def test_greedy_needs_no_random_keys():
    assert Sampler(SamplingConfig(temp=0.0)).keys() is None


def test_top_k_keeps_the_k_most_likely():
    logits = logits_of([0.05, 0.4, 0.1, 0.3, 0.15])
    scores = Sampler(SamplingConfig(temp=1.0, top_k=2)).scores(logits)
    assert kept(scores) == {1, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(Sampler(SamplingConfig(temp=1.0, top_p=0.5)).scores(logits)) == {0}
    assert kept(Sampler(SamplingConfig(temp=1.0, top_p=0.7)).scores(logits)) == {0, 1}
    assert kept(Sampler(SamplingConfig(temp=1.0, top_p=0.85)).scores(logits)) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = logits_of([0.5, 0.3, 0.12, 0.08])
    # threshold 0.2 * 0.5 = 0.1: 0.12 survives, 0.08 does not
    assert kept(Sampler(SamplingConfig(temp=1.0, min_p=0.2)).scores(logits)) == {0, 1, 2}


def test_masks_intersect_and_the_rest_is_renormalized():
    logits = logits_of([0.4, 0.3, 0.2, 0.06, 0.04])
    sampler = Sampler(SamplingConfig(temp=0.5, top_k=3, top_p=0.95, min_p=0.6))
    scores = sampler.scores(logits)
    assert kept(scores) == {0, 1}  # min_p (0.24) is the tightest
    probs = np.array(sampler.probabilities(scores)[0])
    expected = np.array([0.4, 0.3]) ** 2  # temperature 0.5 squares the ratio
    assert probs.sum() == pytest.approx(1.0, abs=1e-6)
    assert probs[:2] == pytest.approx(expected / expected.sum(), rel=1e-5)


@pytest.mark.parametrize(
    ("temp", "top_p", "top_k", "min_p"),
    [
        (0.7, 0.9, 40, 0.02),
        (1.3, 0.8, 0, 0.0),
        (0.5, 1.0, 7, 0.0),
        (1.0, 1.0, 0, 0.1),
        (0.9, 0.6, 150, 0.0),
    ],
)
def test_distribution_matches_mlx_lm_sampler_chain(temp, top_p, top_k, min_p):
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logits = mx.random.normal((4, 200), key=mx.random.key(3)) * 3
    theirs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if top_p < 1.0:
        theirs = apply_top_p(theirs, top_p)
    if min_p > 0.0:
        theirs = apply_min_p(theirs, min_p)
    if top_k > 0:
        theirs = apply_top_k(theirs, top_k)
    theirs = mx.softmax(theirs / temp, axis=-1)
    sampler = Sampler(SamplingConfig(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p))
    ours = sampler.probabilities(sampler.scores(logits))
    assert np.allclose(np.array(ours), np.array(theirs), atol=1e-6)


def test_greedy_probabilities_are_the_point_mass_at_the_argmax():
    sampler = Sampler(SamplingConfig(temp=0.0))
    logits = mx.array([[0.1, 3.0, -2.0, 2.9]])
    assert np.array(sampler.probabilities(sampler.scores(logits))).tolist() == [
        [0.0, 1.0, 0.0, 0.0]
    ]


def test_temperature_sampling_follows_the_softmax():
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    temp, draws = 0.8, 40000
    sampler = Sampler(SamplingConfig(temp=temp, seed=11))
    scores = sampler.scores(mx.broadcast_to(logits, (draws, 6)))
    tokens = np.array(sampler.sample(scores, sampler.keys().next()))
    freq = np.bincount(tokens, minlength=6) / draws
    expected = np.array(mx.softmax(logits[0] / temp))
    # 4 standard errors of the largest bin: a correct sampler fails this about never
    assert np.abs(freq - expected).max() < 4 * math.sqrt(0.25 / draws)


def test_a_seed_reproduces_the_draws_whatever_else_is_drawn():
    sampler = Sampler(SamplingConfig(temp=1.0, seed=42))
    logits = mx.zeros((1, 50))

    def run():
        keys = sampler.keys()
        out = []
        for _ in range(20):
            mx.random.uniform(shape=(3,))  # unrelated global draws must not matter
            out.append(sampler(logits, None, keys.next()).item())
        return out

    first, second = run(), run()
    assert first == second
    other = Sampler(SamplingConfig(temp=1.0, seed=43))
    keys = other.keys()
    assert [other(logits, None, keys.next()).item() for _ in range(20)] != first


def test_position_keyed_draws_follow_the_softmax():
    logits = mx.array([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    temp, draws = 0.8, 40000
    sampler = Sampler(SamplingConfig(temp=temp, seed=11))
    scores = sampler.scores(mx.broadcast_to(logits, (draws, 6)))
    tokens = np.array(sampler.sample(scores, sampler.keys().rows(0, draws)))
    freq = np.bincount(tokens, minlength=6) / draws
    expected = np.array(mx.softmax(logits[0] / temp))
    assert np.abs(freq - expected).max() < 4 * math.sqrt(0.25 / draws)


def test_a_positions_draw_depends_on_its_key_alone_not_on_the_rows_drawn_with_it():
    """What makes a seeded speculative run reproducible: the verifier draws a round's
    positions together, plain decoding one at a time, and each position comes out the same."""
    sampler = Sampler(SamplingConfig(temp=1.0, seed=7))
    keys = sampler.keys()
    scores = sampler.scores(mx.random.normal((6, 300), key=mx.random.key(2)))
    together = np.array(sampler.sample(scores, keys.rows(40, 6))).tolist()
    alone = [sampler.sample(scores[i : i + 1], keys.rows(40 + i)).item() for i in range(6)]
    assert together == alone
    assert np.array(sampler.sample(scores, keys.rows(41, 6))).tolist() != together


def test_unseeded_requests_draw_different_keys():
    assert RandomKeys().seed != RandomKeys().seed  # 32 random bits: a clash is 1 in 4e9


def test_repetition_penalty_matches_mlx_lm():
    from mlx_lm.sample_utils import make_repetition_penalty

    logits = mx.random.normal((1, 64), key=mx.random.key(5))
    history = mx.array([3, 9, 3, 17, 40, 9, 2], dtype=mx.int32)
    theirs = make_repetition_penalty(1.3, 5)(history, mx.array(logits))
    windows = repetition_windows(history, history[:0], 5)
    ours = apply_repetition_penalty(logits, windows, 1.3)
    assert np.allclose(np.array(ours), np.array(theirs))


def test_repetition_windows_give_each_draft_position_its_own_history():
    context = mx.array([1, 2, 3], dtype=mx.int32)
    drafts = mx.array([7, 8], dtype=mx.int32)
    rows = np.array(repetition_windows(context, drafts, 4)).tolist()
    # position i sees context + drafts[:i], its last 4 tokens; short rows repeat their first
    assert rows == [[1, 1, 2, 3], [1, 2, 3, 7], [2, 3, 7, 8]]


def test_batched_scores_equal_one_position_at_a_time():
    config = SamplingConfig(temp=0.9, top_k=20, repetition_penalty=1.5, repetition_context_size=3)
    sampler = Sampler(config)
    logits = mx.random.normal((3, 100), key=mx.random.key(9))
    context = mx.array([4, 5, 6, 7], dtype=mx.int32)
    drafts = mx.array([8, 9], dtype=mx.int32)
    batched = sampler.scores(logits, repetition_windows(context, drafts, 3))
    for i in range(3):
        seen = mx.concatenate([context, drafts[:i]])
        single = sampler.scores(logits[i : i + 1], repetition_windows(seen, seen[:0], 3))
        assert np.allclose(np.array(batched[i]), np.array(single[0]))


# -- top-k with ties at the cut (bf16 logits tie often) ------------------------------------


def tied_bf16_logits(vocab: int = 64, seed: int = 5) -> mx.array:
    """``[1, vocab]`` bf16 logits on a coarse grid, so many tokens share a value."""
    values = mx.round(mx.random.normal((1, vocab), key=mx.random.key(seed)) * 2) / 2
    return values.astype(mx.bfloat16)


def straddling_k(logits: mx.array) -> int:
    """A k whose cut falls inside a run of tied values (the k-th and (k+1)-th are equal)."""
    ordered = np.sort(np.array(logits[0].astype(mx.float32)))[::-1]
    return next(
        k for k in range(2, len(ordered)) if ordered[0] != ordered[k - 1] == ordered[k]
    )


def chi_square_p_value(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the regularized upper incomplete gamma,
    from the series of the lower one (exact enough for a test's p-value)."""
    a, x = df / 2, statistic / 2
    if x == 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-15 * total:
        n += 1
        term *= x / (a + n)
        total += term
    lower = math.exp(a * math.log(x) - x - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_top_k_keeps_exactly_k_tokens_when_ties_straddle_the_cut():
    from mlx_lm.sample_utils import apply_top_k

    logits = tied_bf16_logits()
    k = straddling_k(logits)
    ours = kept(Sampler(SamplingConfig(temp=1.0, top_k=k)).scores(logits))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    assert len(ours) == k
    assert ours == kept(apply_top_k(logprobs, k))


def test_top_k_of_one_is_greedy_even_on_tied_logits():
    logits = mx.concatenate([tied_bf16_logits(seed=s) for s in range(32)])
    logits[:, 7] = logits.max(axis=-1)  # a tie for the best in every row, after the argmax
    sampler = Sampler(SamplingConfig(temp=1.0, top_k=1))
    draws = sampler.sample(sampler.scores(logits), RandomKeys(0).next())
    assert np.array(draws).tolist() == np.array(mx.argmax(logits, axis=-1)).tolist()


@pytest.mark.parametrize("temp", [1.0, 0.6])
def test_top_k_samples_are_distributed_as_mlx_lm_samples_on_tied_logits(temp):
    """A two-sample chi-square test: our draws and mlx-lm's sampler's draws over the same
    tied bf16 logits come from one distribution (p > 0.001; seeded, so deterministic)."""
    from mlx_lm.sample_utils import make_sampler

    logits = tied_bf16_logits()
    k = straddling_k(logits)
    draws = 20_000
    rows = mx.broadcast_to(logits, (draws, logits.shape[-1]))
    sampler = Sampler(SamplingConfig(temp=temp, top_k=k))
    ours = np.array(sampler.sample(sampler.scores(rows), RandomKeys(1).next()))
    mx.random.seed(2)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    theirs = np.array(make_sampler(temp=temp, top_k=k)(logprobs))
    assert set(ours.tolist()) <= set(theirs.tolist()), "we draw tokens mlx-lm never keeps"
    tokens = sorted(set(ours.tolist()) | set(theirs.tolist()))
    table = np.array([[np.sum(side == t) for t in tokens] for side in (ours, theirs)], float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    assert chi_square_p_value(statistic, len(tokens) - 1) > 1e-3


# -- ranking as mlx-lm ranks: log-probabilities in the model's dtype -----------------------


def rounding_tie_logits(vocab: int = 512) -> tuple[mx.array, int, int]:
    """bf16 logits where ids 336 and 231 differ (2.640625 and 2.609375, so 336 ranks first
    in float32) but their bf16 log-probabilities round to one value: the case outside
    testing found (mlx-lm keeps 231, the lower id). Returns the logits and the k whose cut
    falls between the two."""
    noise = np.clip(np.random.RandomState(0).normal(size=(1, vocab)), -4.0, 1.5)
    logits = mx.array(noise).astype(mx.bfloat16)
    logits[0, 10], logits[0, 20] = 3.5, 3.0  # two ranked above the pair
    logits[0, 336] = 2.640625
    logits[0, 231] = 2.609375
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tied = np.flatnonzero(np.array(logprobs[0] == logprobs[0, 336]))
    assert tied.tolist() == [231, 336]  # the construction's point: only these two tie
    k = int(mx.sum(logprobs > logprobs[0, 336]).item()) + 1
    return logits, k, 231


def mlx_lm_processed(logits: mx.array, temp: float, **options) -> mx.array:
    """What mlx-lm's sampler draws from: its log-probabilities through its masks, over the
    temperature (``categorical_sampling``), for one row."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    if 0 < options.get("top_p", 1.0) < 1.0:
        logprobs = apply_top_p(logprobs, options["top_p"])
    if options.get("min_p", 0.0):
        logprobs = apply_min_p(logprobs, options["min_p"])
    if options.get("top_k", 0):
        logprobs = apply_top_k(logprobs, options["top_k"])
    return logprobs * (1.0 / temp)


def test_top_k_on_bf16_keeps_the_set_mlx_lm_keeps_where_rounding_ties_two_ids():
    from mlx_lm.sample_utils import apply_top_k

    logits, k, lower = rounding_tie_logits()
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    theirs = kept(apply_top_k(logprobs, k))
    ours = kept(Sampler(SamplingConfig(temp=1.0, top_k=k)).scores(logits))
    assert ours == theirs
    assert lower in ours and 336 not in ours


def test_greedy_on_bf16_picks_mlx_lm_s_token_where_rounding_ties_the_best_two():
    from mlx_lm.sample_utils import make_sampler

    noise = np.clip(np.random.RandomState(0).normal(size=(1, 512)), -4.0, 1.5)
    logits = mx.array(noise).astype(mx.bfloat16)
    logits[0, 336], logits[0, 231] = 2.578125, 2.546875  # 336 is the argmax of the logits
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    assert logprobs[0, 336].item() == logprobs[0, 231].item()  # rounding ties them
    assert make_sampler(temp=0.0)(logprobs).item() == 231  # and mlx-lm takes the lower id
    assert Sampler(SamplingConfig(temp=0.0))(logits, None, None).item() == 231


@pytest.mark.parametrize("options", [
    {"top_k": 0}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_p": 0.8, "min_p": 0.02},
])
def test_processed_bf16_scores_equal_mlx_lm_s_bit_for_bit(options):
    logits, k, _ = rounding_tie_logits()
    options = {**options, "top_k": options.get("top_k", k)}
    ours = Sampler(SamplingConfig(temp=0.7, **options)).scores(logits)
    theirs = mlx_lm_processed(logits, 0.7, **options).astype(mx.float32)
    assert kept(ours) == kept(theirs)
    finite = np.isfinite(np.array(theirs))
    assert np.array_equal(np.array(ours)[finite], np.array(theirs)[finite])
