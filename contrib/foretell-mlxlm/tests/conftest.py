"""Fixtures: foretell-mlxlm installed for real (entry points and all) into a directory of
its own, so foretell's loader finds it as after ``pip install``; tiny model directories."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from foretell.platform import blas

# Bind the optimized BLAS before anything imports mlx, as foretell.load() would.
blas.preload()

SOURCE = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """foretell-mlxlm on ``sys.path`` as an installed distribution for this session (built
    offline, into the running interpreter's setuptools, from a copy: an in-tree build
    leaves an .egg-info that would make the checkout look installed)."""
    from foretell.plugin.testing import install_distribution

    site = install_distribution(SOURCE, tmp_path_factory.mktemp("mlxlm-site"))
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield site
    sys.path.remove(str(site))
    importlib.invalidate_caches()


@pytest.fixture(scope="session")
def registry(installed):
    from foretell.plugin import load_plugins
    from foretell.plugin.loader import PluginSwitches

    plugins = load_plugins(switches=PluginSwitches())
    assert any(r.name == "mlxlm" and r.status == "loaded" for r in plugins.records), [
        (r.name, r.status, r.error) for r in plugins.records]
    return plugins.registry


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, registry):
    """``model_dir(model_type, seed=0)``: a tiny random-weight directory, made once."""
    from foretell.tools import make_model_dir

    root = tmp_path_factory.mktemp("mlxlm-models")
    made: dict[tuple[str, int], Path] = {}

    def make(model_type: str, seed: int = 0) -> Path:
        key = (model_type, seed)
        if key not in made:
            made[key] = make_model_dir(root / f"{model_type}-{seed}", model_type, seed=seed,
                                       registry=registry)
        return made[key]

    return make
