"""A seed reproduces a sampled speculative run whatever the draft schedule (issue 48):
each position's token is drawn with that position's key, so the text is the one plain
sampling with the seed gives, however the adaptive length cut the run into rounds and plain
steps, and whichever drafter proposed."""

from __future__ import annotations

import random

import pytest

from foretell.config import SamplingConfig
from foretell.spec.policy import DraftLengthPolicy

PROMPT = [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199]


def _use(engine, registry, model_dir, k=4):
    from foretell.plugin import Kind

    config = registry.get(Kind.DRAFT, "two-model").config
    return engine.use_draft("two-model", config(model=str(model_dir)), max_tokens=k)


def _run(engine, speculate, sampling, max_tokens=48, **options):
    events = list(engine.generate(PROMPT, max_tokens=max_tokens, sampling=sampling,
                                  speculate=speculate, ignore_eos=True, **options))
    return [t for e in events[:-1] for t in e.tokens], events[-1]


def _scripted(monkeypatch, lengths):
    """Make the policy choose from ``lengths`` (cycled), as timings measured differently on
    another run would have it choose."""
    chosen = iter(lengths * 1000)
    monkeypatch.setattr(DraftLengthPolicy, "choose", lambda self, limit: min(next(chosen), limit))


@pytest.mark.parametrize("draft", ["qwen3", "qwen3-other"], ids=["self", "disagreeing"])
@pytest.mark.parametrize("options", [{}, {"top_k": 20, "top_p": 0.9}], ids=["plain", "top-k-p"])
def test_a_seeded_run_is_the_same_text_whatever_the_draft_schedule(
    engines, model_dirs, registry, monkeypatch, draft, options
):
    engine = engines["qwen3"]
    speculator = _use(engine, registry, model_dirs[draft])
    sampling = SamplingConfig(temp=0.8, seed=3, **options)
    try:
        texts, mean_ks = [], []
        rng = random.Random(5)
        schedules = [[4], [1, 0, 3], [0, 0, 2, 4, 1], [rng.randrange(5) for _ in range(40)]]
        for lengths in schedules:
            _scripted(monkeypatch, lengths)
            tokens, stats = _run(engine, speculator, sampling)
            texts.append(tokens)
            mean_ks.append(stats.speculation["mean_k"])
        monkeypatch.undo()
    finally:
        engine.use_draft(None)
    assert len(set(mean_ks)) == len(schedules)  # the schedules really differed
    plain, _ = _run(engine, False, sampling)
    assert all(text == plain for text in texts), (texts, plain)
    other_seed, _ = _run(engine, False, SamplingConfig(temp=0.8, seed=4, **options))
    assert other_seed != plain


def test_a_seeded_self_drafter_agrees_with_the_target(engines, model_dirs, registry,
                                                      monkeypatch):
    """The draft model is the target: drawing its drafts with the positions' noise, it
    proposes what the target draws (drawn with a stream of its own, a 512-token vocabulary
    at temperature 1 agreed a few times in a hundred)."""
    engine = engines["qwen3"]
    speculator = _use(engine, registry, model_dirs["qwen3"])
    _scripted(monkeypatch, [4])
    try:
        _, stats = _run(engine, speculator, SamplingConfig(temp=1.0, seed=11))
    finally:
        monkeypatch.undo()
        engine.use_draft(None)
    assert stats.speculation["acceptance"] > 0.9, stats.speculation


def test_the_adaptive_policy_s_seeded_runs_repeat(engines, model_dirs, registry):
    """Each run starts from a fresh policy, which measures this machine's timings anew."""
    engine = engines["qwen3"]
    sampling = SamplingConfig(temp=0.8, seed=5)
    runs = []
    try:
        for _ in range(3):
            speculator = _use(engine, registry, model_dirs["qwen3-other"])
            runs.append(_run(engine, speculator, sampling, max_tokens=64)[0])
    finally:
        engine.use_draft(None)
    assert runs[0] == runs[1] == runs[2] == _run(engine, False, sampling, max_tokens=64)[0]


def test_a_seeded_adaptive_run_resumed_from_a_checkpoint_is_the_same_text(
    model_dirs, registry, monkeypatch, tmp_path
):
    """Interrupted after 24 tokens under one schedule, resumed under another: the text is
    the uninterrupted plain run's with that seed."""
    import foretell
    from foretell.cache.tier import CacheTier
    from foretell.plugin import Kind

    sampling = SamplingConfig(temp=0.8, seed=9)
    config = registry.get(Kind.DRAFT, "two-model").config(model=str(model_dirs["qwen3-other"]))

    def engine():
        made = foretell.load(model_dirs["qwen3"], registry=registry)
        made.cache = CacheTier.for_engine(made, tmp_path)
        made.cache.checkpoint_every = 3
        made.use_draft("two-model", config, max_tokens=4)
        return made

    _scripted(monkeypatch, [4, 0, 1])
    first, seen = engine(), []
    for event in first.generate(PROMPT, max_tokens=48, sampling=sampling, resume=True,
                                ignore_eos=True):
        seen += event.tokens
        if len(seen) >= 24:
            break  # the process "dies": no completion, no cleanup
    assert first.cache.flush(10).durable
    _scripted(monkeypatch, [2, 3, 0, 0])
    resumed, stats = _run(engine(), True, sampling, resume=True)
    monkeypatch.undo()
    assert stats.cached_from == "checkpoint"
    assert resumed == _run(foretell.load(model_dirs["qwen3"], registry=registry), False,
                           sampling)[0]
