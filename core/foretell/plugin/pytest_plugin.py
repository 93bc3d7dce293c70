"""foretell's pytest plugin (``pytest11``): fixtures for plugin authors' tests.

- ``foretell_plugins``: a fresh plugin set with core's own plugins and nothing autoloaded;
  ``with foretell_plugins.temporary(obj, name="mine"): ...`` registers a plugin object for
  the duration of the block.
- ``fake_distribution``: ``fake_distribution(name, version, entry_points=..., modules=...)``
  writes a real installed distribution (a ``.dist-info`` with entry points, plus its
  modules) on ``sys.path`` for the test, so discovery runs exactly as after ``pip install``.

pytest imports this module in every session of every project whose environment has
foretell installed, so it imports nothing beyond ``foretell`` itself at collection: the
fixtures import the plugin machinery (:mod:`foretell.plugin.testing`) when a test asks for them,
and nothing here touches MLX or the BLAS.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def foretell_plugins():
    from foretell.plugin.testing import fresh_plugins

    return fresh_plugins()


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    from foretell.plugin.testing import fake_distributions

    with fake_distributions(tmp_path, monkeypatch) as make:
        yield make
