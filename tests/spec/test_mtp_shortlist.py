"""Qwen-MTP drafting from a shortlist of the vocabulary (``draft_vocab``) changes what is
drafted, never what is emitted: greedy output equals plain greedy decoding, drafts stay
inside the shortlist, and a sampled draft's q is a distribution over the shortlist only."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def demo():
    import foretell

    return foretell.load("demo")


def _mtp(demo, draft_vocab, k):
    from foretell_qwen import MTPConfig

    return demo.use_draft("mtp", MTPConfig(draft_vocab=draft_vocab), max_tokens=k, adaptive=False)


@pytest.mark.parametrize("k", [1, 3])
def test_a_shortlist_head_reproduces_plain_greedy(demo, k):
    speculator = _mtp(demo, 2048, k)
    accepted = 0
    for prompt in ["def fibonacci(n):", "import os\n\n\ndef list_files(path):"]:
        plain = demo.generate_text(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                   speculate=False)
        events = list(demo.generate(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                    speculate=speculator))
        assert "".join(e.text for e in events[:-1]) == plain
        accepted += events[-1].speculation["accepted"]
    assert accepted > 0


def test_shortlist_drafts_and_their_q_stay_below_the_cutoff(demo):
    import mlx.core as mx

    from foretell.config import SamplingConfig
    from foretell.sampling import Sampler
    from foretell.spec import Feed

    speculator = _mtp(demo, 1000, 3)
    sampler = Sampler(SamplingConfig(temp=1.0, seed=3))
    source = speculator.provider.open(demo.target, sampler)
    prompt = demo.tokenizer.encode("def fibonacci(n):\n    return", add_special_tokens=False)
    hidden, _ = demo.model.forward(mx.array([prompt], dtype=mx.int32), demo.model.make_caches())
    source.prefill(Feed(prompt, hidden))
    draft = source.draft(Feed([]), 3)
    assert draft.tokens.shape == (1, 3)
    assert mx.all(draft.tokens < 1000).item()
    q = draft.q
    assert q.shape == (1, 3, demo.model.vocab_size)
    assert mx.allclose(mx.sum(q, axis=-1), mx.ones((1, 3)), atol=1e-5).item()
    assert mx.max(q[..., 1000:]).item() == 0.0


def test_shortlist_logits_are_the_full_heads_below_the_cutoff(demo):
    """Whatever layout the head's weights run in (input-major on a CPU under OpenBLAS)."""
    import mlx.core as mx

    from foretell_qwen.mtp import ShortlistHead

    hidden = mx.random.normal((2, demo.model.args.hidden_size), key=mx.random.key(4))
    full = demo.model.logits(hidden)
    short = ShortlistHead(demo.model, 1000)(hidden)
    assert mx.allclose(short[:, :1000], full[:, :1000], rtol=1e-5, atol=1e-4).item()
    assert mx.all(short[:, 1000:] == -mx.inf).item()
