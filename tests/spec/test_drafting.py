"""What autoregressive drafters record: argmax tokens and no q when greedy; when sampling,
a draw from the processed distribution and that distribution as q."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from foretell.config import SamplingConfig
from foretell.sampling import Sampler
from foretell.spec import Drafting, draft_keys


def test_greedy_drafting_takes_the_argmax_and_records_no_q():
    logits = mx.random.normal((1, 50), key=mx.random.key(0))
    drafting = Drafting(Sampler(), None)
    token = drafting.add(logits)
    draft = drafting.draft()
    assert token.tolist() == [int(mx.argmax(logits, axis=-1).item())]
    assert draft.q is None and draft.tokens.tolist() == [token.tolist()]


def test_sampled_drafting_records_the_distribution_each_token_came_from():
    sampler = Sampler(SamplingConfig(temp=0.7, top_k=5, seed=3))
    drafting = Drafting(sampler, draft_keys(sampler))
    steps = [mx.random.normal((1, 50), key=mx.random.key(i)) for i in range(3)]
    tokens = [drafting.add(logits).item() for logits in steps]
    draft = drafting.draft()
    q = np.array(draft.q)
    assert draft.tokens.tolist() == [tokens] and q.shape == (1, 3, 50)
    np.testing.assert_allclose(q.sum(axis=-1), 1.0, rtol=1e-5)
    for i, (logits, token) in enumerate(zip(steps, tokens)):
        expected = np.array(sampler.probabilities(sampler.scores(logits)))[0]
        np.testing.assert_allclose(q[0, i], expected, rtol=1e-6)
        assert q[0, i, token] > 0 and (q[0, i] > 0).sum() == 5
