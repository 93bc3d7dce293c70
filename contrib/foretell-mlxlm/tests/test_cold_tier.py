"""Adapted models keep their KV on disk as native ones do: an SSD hit in a fresh engine
serves the prefix and decodes as cold decoding does (a recurrent family included: its state
is stored whole and served only at its exact boundary), and an interrupted generation with
``resume=True`` continues from its checkpoint with the tokens an uninterrupted run makes."""

from __future__ import annotations

import pytest

from foretell.config import SamplingConfig

PROMPT = [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199, 18, 5, 77, 31]
MAX_TOKENS = 16


def _engine(registry, path, cache_dir=None):
    import foretell
    from foretell.cache.tier import CacheTier

    engine = foretell.load(path, registry=registry)
    engine.cache = CacheTier.for_engine(engine, cache_dir)
    return engine


def _run(engine, **options):
    events = list(engine.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  speculate=False, **options))
    return [t for e in events[:-1] for t in e.tokens], events[-1]


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_an_ssd_hit_in_a_fresh_engine_serves_the_prefix_and_decodes_as_cold(
        registry, model_dir, tmp_path, model_type):
    path = model_dir(model_type)
    cold, cold_stats = _run(_engine(registry, path))
    writer = _engine(registry, path, tmp_path)
    assert _run(writer)[0] == cold
    assert writer.cache.close(10).durable
    warm, stats = _run(_engine(registry, path, tmp_path))
    assert stats.cached_from == "ssd" and stats.cached_tokens > 0
    assert cold_stats.cached_tokens == 0
    assert warm == cold


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
@pytest.mark.parametrize("sampling", [None, SamplingConfig(temp=0.8, seed=3)],
                         ids=["greedy", "sampled"])
def test_an_interrupted_generation_resumes_with_the_uninterrupted_runs_tokens(
        registry, model_dir, tmp_path, model_type, sampling):
    path = model_dir(model_type)
    whole, _ = _run(_engine(registry, path), sampling=sampling)
    engine = _engine(registry, path, tmp_path)
    engine.cache.checkpoint_every = 3
    seen = []
    for event in engine.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 speculate=False, sampling=sampling, resume=True):
        seen += event.tokens
        if len(seen) >= 8:  # the process "dies" here: no completion, no cleanup
            break
    assert engine.cache.flush(10).durable
    resumed, stats = _run(_engine(registry, path, tmp_path), sampling=sampling, resume=True)
    assert stats.cached_from == "checkpoint"
    assert resumed == whole


def test_asking_an_adapted_model_for_quantized_kv_is_refused_saying_why(registry, model_dir):
    """Its caches are mlx-lm's, which foretell does not quantize: kv_bits would change
    nothing, so the engine says so instead of running with more memory than asked."""
    import foretell
    from foretell.errors import ConfigError

    with pytest.raises(ConfigError, match=r"kv_bits: llama: no layer of this model keeps a "
                                          r"KV cache foretell can quantize .*leave it out"):
        foretell.load(model_dir("llama"), registry=registry, kv_bits=8)
