"""Drafters that cannot serve a target are refused before anything is allocated, with one
message naming target, drafter and reason; a drafter that fails mid-request ends only that
request, naming the plugin."""

from __future__ import annotations

import json
import shutil

import pytest

from foretell.plugin.testing import fresh_plugins
from foretell.spec import DraftError, PairingError
from foretell.tools import make_model_dir


def _two_model(engine, registry, path, k=3):
    from foretell.plugin import Kind

    config = registry.get(Kind.DRAFT, "two-model").config
    return engine.use_draft("two-model", config(model=str(path)), max_tokens=k)


def test_a_draft_of_another_vocabulary_size_is_refused(engines, registry, tmp_path):
    other = make_model_dir(tmp_path / "small-vocab", "qwen3",
                           overrides={"hidden_size": 32, "num_hidden_layers": 1,
                                      "intermediate_size": 64, "vocab_size": 300})
    with pytest.raises(PairingError) as err:
        _two_model(engines["qwen3"], registry, other)
    message = str(err.value)
    assert f"draft model {other}" in message and "vocabularies differ" in message
    assert "draft 300 tokens" in message


def test_a_draft_with_the_same_size_but_other_tokens_is_refused(engines, model_dirs, registry,
                                                                 tmp_path):
    other = tmp_path / "other-tokens"
    shutil.copytree(model_dirs["qwen3-other"], other)
    raw = json.loads((other / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    a, b = list(vocab)[10], list(vocab)[11]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(PairingError, match="tokenizers differ"):
        _two_model(engines["qwen3"], registry, other)


def test_mtp_is_refused_for_a_target_without_an_mtp_head(engines, registry):
    with pytest.raises(PairingError) as err:
        engines["gemma3_text"].use_draft("mtp")
    assert "draft provider 'mtp' cannot draft for target" in str(err.value)
    assert "needs mtp" in str(err.value) and "gemma3_text" in str(err.value)


class _NeedsTaps:
    requires = frozenset({"layer-taps-v9"})

    def prepare(self, target):
        raise AssertionError("prepare must not run for a refused pairing")


class _Broken:
    requires = frozenset()

    def prepare(self, target):
        pass

    def open(self, target, sampler):
        return self

    def prefill(self, feed):
        pass

    def draft(self, feed, n):
        raise RuntimeError("draft head exploded")

    def commit(self, accepted):
        pass

    def close(self):
        pass


class _TooLong(_Broken):
    draft_tokens = 40  # more than a verify window may hold


class _Plugin:
    import foretell

    @staticmethod
    @foretell.hookimpl
    def foretell_register_draft_providers(register):
        register("needs-taps", "tests_spec_pairing_helpers:NeedsTaps")
        register("broken", "tests_spec_pairing_helpers:Broken")
        register("too-long", "tests_spec_pairing_helpers:TooLong")


@pytest.fixture
def plugin_registry(monkeypatch):
    import sys
    import types

    module = types.ModuleType("tests_spec_pairing_helpers")
    module.NeedsTaps, module.Broken, module.TooLong = _NeedsTaps, _Broken, _TooLong
    monkeypatch.setitem(sys.modules, "tests_spec_pairing_helpers", module)
    plugins = fresh_plugins()
    with plugins.temporary(_Plugin, "spec-test-drafters"):
        yield plugins.registry


def test_a_missing_port_is_refused_naming_target_drafter_and_port(engines, plugin_registry):
    engine = engines["qwen3"]
    registry, engine.registry = engine.registry, plugin_registry
    try:
        with pytest.raises(PairingError) as err:
            engine.use_draft("needs-taps")
    finally:
        engine.registry = registry
    message = str(err.value)
    assert "draft provider 'needs-taps' cannot draft for target" in message
    assert "needs layer-taps-v9" in message and "(qwen3)" in message


def test_a_drafters_own_length_out_of_range_is_refused_naming_it(engines, plugin_registry):
    """A plugin's ``draft_tokens`` is checked like ``--num-draft-tokens``; a length given by
    the caller does not need it."""
    from foretell.errors import DraftError

    engine = engines["qwen3"]
    registry, engine.registry = engine.registry, plugin_registry
    try:
        with pytest.raises(DraftError, match=r"draft provider 'too-long' from .*: draft_tokens "
                                             r"must be an integer in 1\.\.16, got 40"):
            engine.use_draft("too-long")
        assert engine.use_draft("too-long", max_tokens=3).max_tokens == 3
    finally:
        engine.use_draft(None)
        engine.registry = registry


def test_a_drafter_failing_inside_draft_ends_that_request_and_the_engine_serves_on(
    engines, plugin_registry
):
    engine = engines["qwen3"]
    registry, engine.registry = engine.registry, plugin_registry
    try:
        broken = engine.use_draft("broken", max_tokens=3, adaptive=False)
    finally:
        engine.registry = registry
    with pytest.raises(DraftError) as err:
        list(engine.generate([1, 2, 3], max_tokens=8, speculate=broken))
    message = str(err.value)
    assert "draft provider 'broken'" in message and "spec-test-drafters" in message
    assert "failed in draft(): RuntimeError: draft head exploded" in message
    text = engine.generate_text([1, 2, 3], max_tokens=8, speculate=False)
    assert text == engine.generate_text([1, 2, 3], max_tokens=8, speculate=False)
    assert list(engine.generate([1, 2, 3], max_tokens=4, speculate=False))[-1].generated_tokens == 4
