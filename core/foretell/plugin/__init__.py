"""The plugin system: hook specs, the registry, discovery and isolation, doc generation.

Plugins import from here: :data:`hookimpl` (also ``foretell.hookimpl``), :class:`Kind`,
:class:`Registrar`, :class:`Registry`, :class:`Contribution`, :class:`Origin`,
:func:`load_plugins`, :class:`PluginSet`, :class:`PluginSwitches`, :class:`PluginRecord`.
A plugin's own tests use the ``foretell_plugins`` and ``fake_distribution`` fixtures of
:mod:`foretell.plugin.pytest_plugin` (helpers in :mod:`foretell.plugin.testing`).

The parts: :mod:`~foretell.plugin.hookspecs` (the contract), :mod:`~foretell.plugin.hooks`
(the typed facade over pluggy),
:mod:`~foretell.plugin.loader` (discovery, load order, per-plugin isolation),
:mod:`~foretell.plugin.registry` (what plugins contributed),
:mod:`~foretell.plugin.baseline` (core's own contributions) and
:mod:`~foretell.plugin.docgen` (``docs/reference/``).

Names resolve on first use: ``import foretell`` imports the hook specs (for ``hookimpl``)
and nothing else of this package (pytest imports foretell in every session).
"""

from __future__ import annotations

from foretell.surface import lazy_exports

_WHERE = {
    "hookimpl": "foretell.plugin.hookspecs",
    "hookspec": "foretell.plugin.hookspecs",
    "Contribution": "foretell.plugin.registry",
    "Kind": "foretell.plugin.registry",
    "Origin": "foretell.plugin.registry",
    "Registrar": "foretell.plugin.registry",
    "Registry": "foretell.plugin.registry",
    "PluginRecord": "foretell.plugin.loader",
    "PluginSet": "foretell.plugin.loader",
    "PluginSwitches": "foretell.plugin.loader",
    "load_plugins": "foretell.plugin.loader",
}

__getattr__, __all__ = lazy_exports(__name__, _WHERE)
