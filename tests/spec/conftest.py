"""Fixtures for speculation tests: tiny random models of real architectures, loaded by
foretell, with drafters of each kind."""

from __future__ import annotations

import pytest

from foretell.tools import make_model_dir

QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
# A window of 8 wraps many times over a 100-token generation.
GEMMA = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
         "sliding_window": 8, "sliding_window_pattern": 3}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-models")
    return {
        "qwen3": make_model_dir(root / "qwen3", "qwen3", overrides=QWEN, seed=0),
        # Another random model of the same vocabulary: it disagrees with the target often.
        "qwen3-other": make_model_dir(root / "qwen3-other", "qwen3", overrides=QWEN, seed=7),
        "gemma3_text": make_model_dir(root / "gemma3", "gemma3_text", overrides=GEMMA, seed=0),
    }


@pytest.fixture(scope="session")
def registry():
    """Every installed plugin, plus contrib's n-gram drafter when it is not installed (it
    is importable from the checkout, see pyproject's pythonpath)."""
    import foretell_ngram
    from foretell.plugin import Kind, load_plugins

    plugins = load_plugins()
    if "ngram" not in plugins.registry.names(Kind.DRAFT):
        plugins.register(foretell_ngram, "ngram")
    return plugins.registry


@pytest.fixture(scope="session")
def engines(model_dirs, registry):
    import foretell

    return {name: foretell.load(path, registry=registry) for name, path in model_dirs.items()}
