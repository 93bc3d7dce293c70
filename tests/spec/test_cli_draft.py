"""``--draft`` and friends resolve through the registry and typed config; ``auto`` uses the
model's measured best drafter for this machine kind; ``--json`` stats show the drafter."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil

import pytest

from foretell.cli.run_cmd import apply_draft, draft_overrides
from foretell.config import DEFAULT_DRAFT_TOKENS, load_run_config
from foretell.errors import ConfigError
from foretell.spec.auto import machine_kind


def _args(**kw):
    base = dict(draft=None, draft_model=None, num_draft_tokens=None, draft_option=None)
    base.update(kw)
    return argparse.Namespace(**base)


def _config(registry, **kw):
    return load_run_config(registry, None, draft_overrides(_args(**kw)))


@contextlib.contextmanager
def _measured(engine, model_dirs, tmp_path, name):
    """The engine pointed at a copy of its model directory named ``name``; yields where that
    copy's ``speculation.json`` goes. Afterwards its own path again, speculation off."""
    model = shutil.copytree(model_dirs["qwen3"], tmp_path / name)
    path, engine.path = engine.path, model
    try:
        yield model / "speculation.json"
    finally:
        engine.path = path
        engine.use_draft(None)


def test_draft_model_selects_two_model_with_that_model(registry, model_dirs):
    config = _config(registry, draft_model=str(model_dirs["qwen3"]), num_draft_tokens=3)
    assert config.draft.kind == "two-model"
    assert config.draft.options.model == str(model_dirs["qwen3"])
    assert config.draft.settings.num_tokens == 3


def test_draft_options_are_typed_by_the_provider(registry):
    config = _config(registry, draft="ngram", draft_option=["max_ngram=2", "min_ngram=1"])
    assert (config.draft.options.max_ngram, config.draft.options.min_ngram) == (2, 1)
    with pytest.raises(ConfigError, match=r"draft.max_ngram: .*\(set by --draft-option\)"):
        _config(registry, draft="ngram", draft_option=["max_ngram='x'"])
    with pytest.raises(ConfigError, match="draft.depth: unknown field"):
        _config(registry, draft="ngram", draft_option=["depth=2"])
    with pytest.raises(ConfigError, match="draft.num_tokens: must be >= 1"):
        _config(registry, draft="ngram", num_draft_tokens=0)


def test_none_turns_speculation_off_and_auto_follows_the_measured_file(
    registry, engines, model_dirs, tmp_path
):
    engine = engines["qwen3"]
    engine.use_draft("ngram")  # an engine that speculated before stops
    apply_draft(engine, _config(registry, draft="none").draft, registry)
    assert engine.speculator is None
    # No speculation.json beside the model: auto means plain decoding.
    engine.use_draft("ngram")
    apply_draft(engine, None, registry)
    assert engine.speculator is None
    with _measured(engine, model_dirs, tmp_path, "measured") as measured:
        measured.write_text(json.dumps({"best": {machine_kind(): {
            "kind": "two-model", "options": {"model": str(model_dirs["qwen3-other"])}}}}))
        apply_draft(engine, None, registry)
        assert engine.speculator.kind == "two-model"
        assert engine.speculator.provider.path == model_dirs["qwen3-other"]
        stats = list(engine.generate([3, 4, 5], max_tokens=6))[-1]
        assert stats.to_dict()["speculation"]["drafter"] == "two-model"


def test_the_shipped_demo_names_a_measured_drafter_for_each_machine_kind():
    from foretell.engine import DEMO_DIR

    best = json.loads((DEMO_DIR / "demo" / "speculation.json").read_text())["best"]
    assert set(best) == {"cpu", "gpu"} and best["cpu"]["kind"] == "two-model"
    assert best["gpu"]["kind"] == "mtp"  # measured on the H200: MTP 1.11-1.33x plain, adaptive
    assert best["gpu"]["num_tokens"] == 6  # up to 6 a round: 1.55x plain, up to 4: 1.26x
    # Sampled MTP lost to plain decoding on the H200 (0.80-1.09x); sampled two-model paid on
    # the CPU (1.13x), so only the GPU entry leaves sampled requests to plain decoding.
    assert best["gpu"]["sampled"] is False and "sampled" not in best["cpu"]


def test_a_drafter_measured_for_greedy_requests_only_leaves_sampled_ones_plain(
    registry, engines, model_dirs, tmp_path
):
    from foretell.config import SamplingConfig

    engine = engines["qwen3"]
    sampled = SamplingConfig(temp=0.8, seed=3)
    with _measured(engine, model_dirs, tmp_path, "measured-greedy-only") as measured:
        plain = list(engine.generate([3, 4, 5, 3, 4], max_tokens=8, sampling=sampled))
        measured.write_text(json.dumps({"best": {machine_kind(): {"kind": "ngram",
                                                                  "sampled": False}}}))
        apply_draft(engine, None, registry)
        assert engine.speculator.kind == "ngram" and engine.speculator.sampled is False
        greedy = list(engine.generate([3, 4, 5, 3, 4], max_tokens=8))[-1]
        assert greedy.to_dict()["speculation"]["drafter"] == "ngram"
        again = list(engine.generate([3, 4, 5, 3, 4], max_tokens=8, sampling=sampled))
        assert again[-1].to_dict().get("speculation") is None  # decoded plainly
        text = [e.text for e in again if e.type == "text"]
        assert text == [e.text for e in plain if e.type == "text"]
        # A drafter the user names speculates on sampled requests as well.
        apply_draft(engine, _config(registry, draft="ngram").draft, registry)
        assert engine.speculator.sampled is True
        measured.write_text(json.dumps({"best": {machine_kind(): {"kind": "ngram",
                                                                  "sampled": "no"}}}))
        with pytest.raises(ConfigError, match=rf"speculation.json.*best.{machine_kind()}.sampled: "
                                              r"must be true or false, got 'no'"):
            apply_draft(engine, None, registry)


def test_auto_drafts_the_measured_number_of_tokens_unless_the_user_sets_one(
    registry, engines, model_dirs, tmp_path
):
    engine = engines["qwen3"]
    with _measured(engine, model_dirs, tmp_path, "measured-tokens") as measured:
        measured.write_text(json.dumps({"best": {machine_kind(): {"kind": "ngram", "num_tokens": 7}}}))
        apply_draft(engine, None, registry)
        assert engine.speculator.max_tokens == 7
        apply_draft(engine, _config(registry, draft="auto", num_draft_tokens=2).draft, registry)
        assert engine.speculator.max_tokens == 2  # --num-draft-tokens wins
        measured.write_text(json.dumps({"best": {machine_kind(): {"kind": "ngram"}}}))
        apply_draft(engine, None, registry)
        assert engine.speculator.max_tokens == 16  # nothing measured: the drafter's own
        measured.write_text(json.dumps({"best": {machine_kind(): {"kind": "ngram", "num_tokens": 0}}}))
        with pytest.raises(ConfigError, match=rf"speculation.json.*best.{machine_kind()}.num_tokens: "
                                              r"must be an integer in 1..16, got 0"):
            apply_draft(engine, None, registry)


def test_a_measured_none_means_plain_decoding_on_that_machine(
    registry, engines, model_dirs, tmp_path
):
    engine = engines["qwen3"]
    with _measured(engine, model_dirs, tmp_path, "measured-none") as measured:
        measured.write_text(json.dumps({"best": {machine_kind(): {"kind": "none"}}}))
        engine.use_draft("ngram")
        apply_draft(engine, None, registry)
        assert engine.speculator is None


def test_a_drafter_named_without_a_length_drafts_its_own_preferred_length(
    registry, engines, model_dirs
):
    """Prompt lookup drafts up to 16 unless told (a copy span is long and free to draft), a
    draft model the engine's default 4; a given length always wins."""
    engine = engines["qwen3"]
    try:
        apply_draft(engine, _config(registry, draft="ngram").draft, registry)
        assert engine.speculator.max_tokens == 16
        apply_draft(engine, _config(registry, draft="ngram", num_draft_tokens=5).draft, registry)
        assert engine.speculator.max_tokens == 5
        apply_draft(engine, _config(registry, draft_model=str(model_dirs["qwen3-other"])).draft,
                    registry)
        assert engine.speculator.max_tokens == DEFAULT_DRAFT_TOKENS == 4
        assert engine.use_draft("ngram", max_tokens=3).max_tokens == 3
    finally:
        engine.use_draft(None)
