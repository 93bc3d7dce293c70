"""Fixtures: a tiny random Qwen3 target loaded by foretell, with the n-gram drafter in its
registry (installed, or registered from this checkout when it is not)."""

from __future__ import annotations

import pytest

from foretell.platform import blas

# Bind the optimized BLAS before anything imports mlx, as foretell.load() would.
blas.preload()

# A small vocabulary: this seed's greedy output repeats itself, so lookups are kept.
TINY_QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
             "vocab_size": 64}


@pytest.fixture(scope="session")
def registry():
    import foretell_ngram
    from foretell.plugin import Kind, load_plugins
    from foretell.plugin.loader import PluginSwitches

    plugins = load_plugins(switches=PluginSwitches())
    if "ngram" not in plugins.registry.names(Kind.DRAFT):
        plugins.register(foretell_ngram, "ngram")
    return plugins.registry


@pytest.fixture(scope="session")
def engine(tmp_path_factory, registry):
    import foretell
    from foretell.tools import make_model_dir

    path = make_model_dir(tmp_path_factory.mktemp("ngram-target") / "qwen3", "qwen3",
                          overrides=TINY_QWEN, seed=1, registry=registry)
    return foretell.load(path, registry=registry)
