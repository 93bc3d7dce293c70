"""Test helpers for plugin authors, auto-registered as a pytest plugin (``pytest11``).

Fixtures:

- ``foretell_plugins``: a fresh plugin set with core's own plugins and nothing autoloaded;
  ``with foretell_plugins.temporary(obj, name="mine"): ...`` registers a plugin object for
  the duration of the block.
- ``fake_distribution``: ``fake_distribution(name, version, entry_points=..., modules=...)``
  writes a real installed distribution (a ``.dist-info`` with entry points, plus its
  modules) on ``sys.path`` for the test, so discovery runs exactly as after ``pip install``.

This module must stay cheap to import: pytest loads it in every session of every project
that has foretell installed.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from foretell.plugins import PluginRecord, PluginSet, PluginSwitches


class TestPluginSet(PluginSet):
    """A plugin set that never discovers entry points on its own."""

    __test__ = False  # not a test class, whatever its name says

    def load_entry_points(self) -> None:
        raise RuntimeError(
            "this test plugin set does not autoload entry points; register plugins with "
            "temporary() or build a PluginSet for discovery tests"
        )

    @contextlib.contextmanager
    def temporary(self, plugin: Any, name: str, **origin: Any) -> Iterator[PluginRecord]:
        record = self.register(plugin, name, **origin)
        try:
            yield record
        finally:
            self.unregister(name)


def fresh_plugins() -> TestPluginSet:
    plugins = TestPluginSet(PluginSwitches())
    plugins.load_core()
    return plugins


def write_distribution(
    root: Path,
    name: str,
    version: str = "0.1.0",
    *,
    entry_points: Mapping[str, Mapping[str, str]] | None = None,
    modules: Mapping[str, str] | None = None,
) -> Path:
    """Write an installed distribution under ``root``: ``<name>-<version>.dist-info`` with
    METADATA and entry_points.txt, plus ``modules`` (``{"pkg.mod": source}``)."""
    root.mkdir(parents=True, exist_ok=True)
    dist_info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8"
    )
    sections = []
    for group, eps in (entry_points or {}).items():
        lines = "\n".join(f"{k} = {v}" for k, v in eps.items())
        sections.append(f"[{group}]\n{lines}\n")
    (dist_info / "entry_points.txt").write_text("\n".join(sections), encoding="utf-8")
    (dist_info / "RECORD").write_text("", encoding="utf-8")
    for dotted, source in (modules or {}).items():
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            pkg = root.joinpath(*parts[:i])
            pkg.mkdir(exist_ok=True)
            (pkg / "__init__.py").touch()
        target = root.joinpath(*parts[:-1], parts[-1] + ".py")
        target.write_text(textwrap.dedent(source), encoding="utf-8")
    return root


@pytest.fixture
def foretell_plugins() -> TestPluginSet:
    return fresh_plugins()


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    created: list[str] = []

    def make(name: str, version: str = "0.1.0", **kwargs: Any) -> Path:
        root = write_distribution(tmp_path / f"site-{len(created)}", name, version, **kwargs)
        monkeypatch.syspath_prepend(str(root))
        created.extend(kwargs.get("modules") or {})
        importlib.invalidate_caches()
        return root

    yield make
    for module in created:
        top = module.split(".")[0]
        for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
            del sys.modules[loaded]
