"""On a device that compiles kernels per window length (CUDA), preparing a speculator runs
every verify-window length once, before any request; elsewhere it does nothing extra."""

from __future__ import annotations

from foretell.spec import verifier


def _window_lengths(engine, monkeypatch, cuda: bool, kind: str = "ngram", max_tokens: int = 5):
    lengths = []
    forward = engine.model.forward

    def counting(tokens, caches, *args, **kwargs):
        lengths.append(tokens.shape[1])
        return forward(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(verifier, "compiles_per_shape", lambda: cuda)
    monkeypatch.setattr(engine.model, "forward", counting)
    try:
        engine.use_draft(kind, max_tokens=max_tokens)
    finally:
        engine.use_draft(None)
    return lengths


def test_a_compiling_device_runs_every_window_length_once_when_the_drafter_is_prepared(
    engines, monkeypatch
):
    lengths = _window_lengths(engines["qwen3"], monkeypatch, cuda=True)
    windows = [n for i, n in enumerate(lengths) if i % 2 == 1]  # each after an 8-token context
    assert windows == [1, 2, 3, 4, 5, 6]


def test_other_devices_prepare_without_extra_forwards(engines, monkeypatch):
    assert _window_lengths(engines["qwen3"], monkeypatch, cuda=False) == []


def test_generation_after_warming_is_unchanged(engines, monkeypatch):
    engine = engines["qwen3"]
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = [t for e in engine.generate(prompt, max_tokens=24, speculate=False)
             if e.type == "text" for t in e.tokens]
    monkeypatch.setattr(verifier, "compiles_per_shape", lambda: True)
    spec = engine.use_draft("ngram", max_tokens=5)
    try:
        out = [t for e in engine.generate(prompt, max_tokens=24, speculate=spec)
               if e.type == "text" for t in e.tokens]
    finally:
        engine.use_draft(None)
    assert out == plain
