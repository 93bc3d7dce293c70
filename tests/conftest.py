import pytest

from foretell import blas

# This suite runs the engine on the CPU throughout; bind the optimized BLAS before any test
# module imports mlx, as `foretell.load()` would (importing foretell alone no longer does).
blas.preload()

_PLUGIN_ENV = ("FORETELL_LOAD_PLUGINS", "FORETELL_DISABLE_PLUGINS", "FORETELL_STRICT_PLUGINS")


@pytest.fixture(autouse=True)
def _no_plugin_env_leaks(monkeypatch):
    # The developer's (or CI's) plugin switches must not change what a test sees.
    for name in _PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
