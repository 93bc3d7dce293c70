"""Greedy speculation is token-identical to plain greedy decoding, for every drafter,
wherever generation stops (EOS inside a draft, max_tokens inside a burst, stop strings) and
for a sliding-window target long past its window. The oracle is foretell's own plain
decoding on the same weights, run as it runs."""

from __future__ import annotations

import random

import pytest

from foretell.sampling import Sampler

PROMPTS = [
    [5],  # a 1-token prompt: nothing to prefill, the token heads the first round
    [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199],
    # Repetitive: prompt lookup finds matches, and so do draft models.
    [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42],
    [random.Random(3).randrange(1, 500) for _ in range(40)],
]


def _drafters(engine, name, model_dirs):
    yield "two-model self", ("two-model", {"model": str(model_dirs[name])})
    if name == "qwen3":
        yield "two-model other", ("two-model", {"model": str(model_dirs["qwen3-other"])})
    yield "ngram", ("ngram", {"max_ngram": 3})


def _use(engine, kind, options, registry, k, adaptive=False):
    from foretell.plugin import Kind

    config = registry.get(Kind.DRAFT, kind).config
    return engine.use_draft(kind, config(**options), max_tokens=k, adaptive=adaptive)


def _tokens(engine, prompt, *, speculate, **options):
    events = list(engine.generate(prompt, speculate=speculate, **options))
    text = "".join(e.text for e in events[:-1])
    return [t for e in events[:-1] for t in e.tokens], text, events[-1]


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_every_drafter_reproduces_plain_greedy(engines, model_dirs, registry, name, k):
    engine = engines[name]
    for label, (kind, options) in _drafters(engine, name, model_dirs):
        speculator = _use(engine, kind, options, registry, k)
        for prompt in PROMPTS:
            plain, _, _ = _tokens(engine, prompt, speculate=False, max_tokens=60, ignore_eos=True)
            spec, _, stats = _tokens(engine, prompt, speculate=speculator, max_tokens=60,
                                     ignore_eos=True)
            assert spec == plain, f"{label}, k={k}, prompt {prompt[:5]}..."
            assert stats.speculation["target_forwards"] <= len(plain)


def test_a_sliding_window_target_keeps_speculating_long_past_its_window(
    engines, model_dirs, registry
):
    engine = engines["gemma3_text"]
    speculator = _use(engine, "two-model", {"model": str(model_dirs["gemma3_text"])}, registry, 4)
    prompt = PROMPTS[1]
    plain, _, _ = _tokens(engine, prompt, speculate=False, max_tokens=160, ignore_eos=True)
    spec, _, stats = _tokens(engine, prompt, speculate=speculator, max_tokens=160, ignore_eos=True)
    assert spec == plain
    # Self-drafting accepts everything: 160 tokens (20 windows) in about 160 / 5 rounds.
    assert stats.speculation["tokens_per_target_forward"] > 4.0


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_eos_inside_an_accepted_draft_ends_generation_unemitted(
    engines, model_dirs, registry, monkeypatch, name
):
    engine = engines[name]
    prompt = PROMPTS[1]
    plain, _, _ = _tokens(engine, prompt, speculate=False, max_tokens=40, ignore_eos=True)
    speculator = _use(engine, "two-model", {"model": str(model_dirs[name])}, registry, 6)
    for at in (0, 2, 5, 9, 17):
        eos = plain[at]
        monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({eos}))
        expected, _, plain_stats = _tokens(engine, prompt, speculate=False, max_tokens=40)
        got, _, stats = _tokens(engine, prompt, speculate=speculator, max_tokens=40)
        assert got == expected == plain[: plain.index(eos)]
        assert stats.finish_reason == plain_stats.finish_reason == "eos"
        assert stats.generated_tokens == plain_stats.generated_tokens


def test_max_tokens_inside_a_burst_cuts_exactly(engines, model_dirs, registry):
    engine = engines["qwen3"]
    speculator = _use(engine, "two-model", {"model": str(model_dirs["qwen3"])}, registry, 6)
    prompt = PROMPTS[2]
    for limit in (1, 2, 3, 5, 7, 8, 13):
        plain, _, p_stats = _tokens(engine, prompt, speculate=False, max_tokens=limit,
                                    ignore_eos=True)
        spec, _, s_stats = _tokens(engine, prompt, speculate=speculator, max_tokens=limit,
                                   ignore_eos=True)
        assert spec == plain and len(spec) == limit
        assert s_stats.generated_tokens == p_stats.generated_tokens == limit
        assert s_stats.finish_reason == "length"


def test_stop_strings_cut_a_burst_where_plain_decoding_stops(engines, model_dirs, registry):
    engine = engines["qwen3"]
    speculator = _use(engine, "two-model", {"model": str(model_dirs["qwen3"])}, registry, 6)
    prompt = PROMPTS[1]
    _, text, _ = _tokens(engine, prompt, speculate=False, max_tokens=50, ignore_eos=True)
    stops = [text[i : i + 3] for i in (4, 11, 25) if text[i : i + 3].strip()]
    assert stops
    for stop in stops:
        p_tokens, p_text, p_stats = _tokens(engine, prompt, speculate=False, max_tokens=50,
                                            stop=[stop], ignore_eos=True)
        s_tokens, s_text, s_stats = _tokens(engine, prompt, speculate=speculator,
                                            max_tokens=50, stop=[stop], ignore_eos=True)
        assert s_text == p_text and stop not in s_text
        assert s_tokens == p_tokens
        assert s_stats.finish_reason == p_stats.finish_reason == "stop"


def test_adaptive_length_keeps_greedy_output(engines, model_dirs, registry):
    engine = engines["qwen3"]
    speculator = _use(engine, "two-model", {"model": str(model_dirs["qwen3-other"])}, registry,
                      4, adaptive=True)
    for prompt in PROMPTS:
        plain, _, _ = _tokens(engine, prompt, speculate=False, max_tokens=80, ignore_eos=True)
        spec, _, _ = _tokens(engine, prompt, speculate=speculator, max_tokens=80, ignore_eos=True)
        assert spec == plain


def test_speculation_stats_describe_the_rounds(engines, model_dirs, registry):
    engine = engines["qwen3"]
    speculator = _use(engine, "two-model", {"model": str(model_dirs["qwen3"])}, registry, 4)
    _, _, stats = _tokens(engine, PROMPTS[1], speculate=speculator, max_tokens=41, ignore_eos=True)
    spec = stats.speculation
    # Self-drafting: every draft accepted, 5 tokens per forward, 41 = 8 * 5 + 1.
    assert spec["drafter"] == "two-model"
    assert spec["acceptance"] == 1.0 and spec["acceptance_by_position"] == [1.0] * 4
    assert spec["target_forwards"] == 9 and spec["drafted"] == 32 == spec["accepted"]
    assert spec["mean_k"] == pytest.approx(32 / 9)
    assert spec["tokens_per_target_forward"] == pytest.approx(41 / 9)
    assert Sampler().greedy
