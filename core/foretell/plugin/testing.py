"""Test helpers for plugin authors, behind the fixtures of :mod:`foretell.plugin.pytest_plugin`.

- :func:`fresh_plugins`: a :class:`TestPluginSet` with core's own plugins, nothing
  autoloaded (the ``foretell_plugins`` fixture).
- :func:`write_distribution` / :func:`fake_distributions`: real installed distributions
  (``.dist-info`` with entry points, plus modules) on ``sys.path``, so discovery runs as
  after ``pip install`` (the ``fake_distribution`` fixture).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from foretell.plugin.loader import PluginRecord, PluginSet, PluginSwitches


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


@contextlib.contextmanager
def fake_distributions(root: Path, monkeypatch: Any) -> Iterator[Any]:
    """``make(name, version, entry_points=..., modules=...)`` writes a distribution under
    ``root`` and puts it on ``sys.path``; on exit its modules leave ``sys.modules``."""
    created: list[str] = []

    def make(name: str, version: str = "0.1.0", **kwargs: Any) -> Path:
        site = write_distribution(root / f"site-{len(created)}", name, version, **kwargs)
        monkeypatch.syspath_prepend(str(site))
        created.extend(kwargs.get("modules") or {})
        importlib.invalidate_caches()
        return site

    try:
        yield make
    finally:
        for module in created:
            top = module.split(".")[0]
            for loaded in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[loaded]
