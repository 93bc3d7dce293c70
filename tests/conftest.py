import pytest

_PLUGIN_ENV = ("FORETELL_LOAD_PLUGINS", "FORETELL_DISABLE_PLUGINS", "FORETELL_STRICT_PLUGINS")


@pytest.fixture(autouse=True)
def _no_plugin_env_leaks(monkeypatch):
    # The developer's (or CI's) plugin switches must not change what a test sees.
    for name in _PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)
