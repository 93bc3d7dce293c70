"""Speculation on an adapted hybrid model (qwen3_next: gated delta-net recurrence, whose
state cannot be trimmed, beside attention) keeps exactly the accepted prefix: the journal
puts every cache back and replays the kept tokens, so output equals plain decoding."""

from __future__ import annotations

import pytest

from foretell.config import SamplingConfig
from foretell.plugin import Kind

PROMPTS = [[11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199],
           [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42]]


def _perturbed(source, target, scale=0.1):
    import shutil

    import mlx.core as mx

    shutil.copytree(source, target, dirs_exist_ok=True)
    weights = mx.load(str(target / "model.safetensors"))
    keys = iter(mx.random.split(mx.random.key(11), len(weights)))
    noisy = {name: w + scale * mx.std(w) * mx.random.normal(w.shape, key=next(keys))
             for name, w in weights.items()}
    mx.save_safetensors(str(target / "model.safetensors"), noisy, metadata={"format": "mlx"})
    return target


def _tokens(events):
    return [t for e in events[:-1] for t in e.tokens], events[-1]


@pytest.fixture(scope="module")
def hybrid(registry, model_dir, tmp_path_factory):
    import foretell
    from foretell.spec import make_speculator

    target = model_dir("qwen3_next")
    engine = foretell.load(target, registry=registry)
    # The target's weights with noise: it agrees with the target often but not always, so
    # rounds end in partial acceptances and the recurrent state is rolled back mid-draft.
    options = registry.get(Kind.DRAFT, "two-model").config(
        model=str(_perturbed(target, tmp_path_factory.mktemp("draft"))))
    speculator = make_speculator(registry, engine.target, "two-model", options, max_tokens=3,
                                 adaptive=False)
    return engine, speculator


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculation_on_a_hybrid_model_equals_plain_decoding(hybrid, prompt):
    engine, speculator = hybrid
    plain, _ = _tokens(list(engine.generate(prompt, max_tokens=40, ignore_eos=True,
                                            speculate=False)))
    spoken, stats = _tokens(list(engine.generate(prompt, max_tokens=40, ignore_eos=True,
                                                 speculate=speculator)))
    assert spoken == plain
    spec = stats.speculation
    assert 0 < spec["accepted"] < spec["drafted"], spec  # rejections were rolled back


def test_seeded_sampled_speculation_on_a_hybrid_model_draws_what_plain_sampling_draws(hybrid):
    engine, speculator = hybrid
    for seed in (1, 2, 3):
        sampling = SamplingConfig(temp=0.8, seed=seed)
        plain, _ = _tokens(list(engine.generate(PROMPTS[0], max_tokens=24, ignore_eos=True,
                                                sampling=sampling, speculate=False)))
        spoken, _ = _tokens(list(engine.generate(PROMPTS[0], max_tokens=24, ignore_eos=True,
                                                 sampling=sampling, speculate=speculator)))
        assert spoken == plain, seed


def test_a_journaled_rollback_is_the_state_of_the_kept_tokens_alone(registry, model_dir):
    import mlx.core as mx

    from foretell.model.kvcache import trim_all
    from foretell.model.loading import load_model

    model = load_model(model_dir("qwen3_next"), registry)
    tokens = mx.array([[3, 9, 27, 81, 243, 5, 15, 45]], dtype=mx.int32)
    rolled, fresh = model.make_caches(), model.make_caches()
    model.forward(tokens[:, :3], rolled)
    model.forward(tokens[:, 3:], rolled)  # five more, then keep two of them
    assert trim_all(rolled, 3) == 3
    assert [c.offset for c in rolled] == [5] * len(rolled)
    model.forward(tokens[:, :5], fresh)
    after = mx.array([[7]], dtype=mx.int32)
    one, _ = model.forward(after, rolled)
    two, _ = model.forward(after, fresh)
    assert mx.allclose(model.logits(one), model.logits(two), atol=1e-4)

