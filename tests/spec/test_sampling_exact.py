"""Sampled speculation is distribution-exact: at every position, the tokens the verifier
emits are distributed as plain sampling's, whatever the draft distribution q.

The oracle is plain sampling as it runs (``Sampler.sample``, i.e. ``mx.random.categorical``
over the processed scores) drawn the same number of times: a two-sample chi-square test
compares the two, per position, on a tiny vocabulary, 40,000 rounds per case. The rounds
go through the verifier's own acceptance rule, batched over rows; a deliberately wrong
rule (resampling from p instead of the residual) must fail the same test.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from foretell.config import SamplingConfig
from foretell.sampling import Sampler
from foretell.spec import acceptance

ROUNDS = 40_000
VOCAB = 12
DRAFTS = 3

CASES = {
    "temperature": SamplingConfig(temp=0.8),
    "top-k": SamplingConfig(temp=1.0, top_k=5),
    "top-p": SamplingConfig(temp=1.2, top_p=0.8),
    "top-k + top-p + min-p": SamplingConfig(temp=0.7, top_k=8, top_p=0.9, min_p=0.05),
}


def _chi_square_p(a: np.ndarray, b: np.ndarray) -> float:
    """p-value that two count vectors come from one distribution (Wilson-Hilferty tail)."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    if len(a) < 2:
        return 1.0
    na, nb = a.sum(), b.sum()
    stat = (((a * math.sqrt(nb / na) - b * math.sqrt(na / nb)) ** 2) / (a + b)).sum()
    df = len(a) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _distributions(sampler: Sampler, seed: int):
    """Target scores for the n + 1 positions and a draft's: the target's logits plus noise,
    so the draft agrees often (every position is reached) but is never the same."""
    key_p, key_q = mx.random.split(mx.random.key(seed))
    logits = mx.random.normal((DRAFTS + 1, VOCAB), key=key_p) * 2.0
    target = sampler.scores(logits)
    draft = sampler.scores(logits[:DRAFTS] + mx.random.normal((DRAFTS, VOCAB), key=key_q))
    return target, draft


def _speculative_tokens(sampler, target_scores, draft_scores, seed):
    """Run ROUNDS verifier rounds; per position, the tokens emitted there (-1: none)."""
    key_d, key_v = mx.random.split(mx.random.key(seed + 1))
    q = sampler.probabilities(draft_scores)
    drafts = mx.random.categorical(
        mx.broadcast_to(mx.log(q), (ROUNDS, DRAFTS, VOCAB)), key=key_d
    ).astype(mx.int32)
    p = mx.broadcast_to(sampler.probabilities(target_scores), (ROUNDS, DRAFTS + 1, VOCAB))
    q = mx.broadcast_to(q, (ROUNDS, DRAFTS, VOCAB))
    accepted, chosen, _ = acceptance.accept_or_resample(p, drafts, q, key_v)
    accepted, chosen, drafts = np.array(accepted), np.array(chosen), np.array(drafts)
    out = np.full((ROUNDS, DRAFTS + 1), -1)
    for i in range(DRAFTS + 1):
        if i < DRAFTS:
            out[:, i] = np.where(accepted > i, drafts[:, i], -1)
        out[:, i] = np.where(accepted == i, chosen, out[:, i])
    return out


def _plain_tokens(sampler, target_scores, seed):
    keys = mx.random.split(mx.random.key(seed + 2), DRAFTS + 1)
    return [
        np.array(sampler.sample(mx.broadcast_to(target_scores[i], (ROUNDS, VOCAB)), keys[i]))
        for i in range(DRAFTS + 1)
    ]


def _worst_p_value(config: SamplingConfig, seed: int = 0) -> float:
    sampler = Sampler(config)
    target, draft = _distributions(sampler, seed)
    spec = _speculative_tokens(sampler, target, draft, seed)
    plain = _plain_tokens(sampler, target, seed)
    worst = 1.0
    for i in range(DRAFTS + 1):
        emitted = spec[:, i][spec[:, i] >= 0]
        assert len(emitted) > 2_000, f"position {i} too rarely reached to test"
        a = np.bincount(emitted, minlength=VOCAB)
        b = np.bincount(plain[i], minlength=VOCAB)
        # Tokens plain sampling can never draw (masked by top-k/p) must never appear.
        assert not a[b == 0].any() or b[a > 0].all(), f"position {i}: a masked token emitted"
        worst = min(worst, _chi_square_p(a, b))
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_rejection_sampling_matches_plain_sampling_at_every_position(case):
    assert _worst_p_value(CASES[case]) > 1e-4


def test_a_wrong_residual_fails_the_same_test(monkeypatch):
    # A common bug: after a rejection, resample from p instead of max(p - q, 0).
    monkeypatch.setattr(acceptance, "residual", lambda p, q: p)
    assert _worst_p_value(CASES["temperature"]) < 1e-6


def test_deterministic_drafts_are_point_masses():
    """q = None (prompt lookup): draft d is kept with probability p(d), else the token is
    drawn from p without d; the emitted token is distributed as p."""
    sampler = Sampler(SamplingConfig(temp=1.0))
    target = sampler.scores(mx.random.normal((2, VOCAB), key=mx.random.key(5)) * 2.0)
    p = mx.broadcast_to(sampler.probabilities(target), (ROUNDS, 2, VOCAB))
    drafts = mx.full((ROUNDS, 1), 3, dtype=mx.int32)
    accepted, chosen, _ = acceptance.accept_or_resample(p, drafts, None, mx.random.key(6))
    first = np.where(np.array(accepted) >= 1, 3, np.array(chosen))
    plain = np.array(sampler.sample(mx.broadcast_to(target[0], (ROUNDS, VOCAB)), mx.random.key(7)))
    assert _chi_square_p(np.bincount(first, minlength=VOCAB), np.bincount(plain, minlength=VOCAB)) > 1e-4
