"""Plugin discovery and loading, with per-plugin isolation.

Load order: core's own internal plugins, then entry points in group ``foretell.plugins``
(built-ins first, then third parties, each group sorted by name). A plugin that fails to
import, fails validation, needs a newer plugin API, or raises inside a registration hook
is recorded with its error and takes nothing else down. ``FORETELL_STRICT_PLUGINS=1``
turns any such failure into an error (CI uses it).

Environment switches (comma-separated entry-point names):

- ``FORETELL_LOAD_PLUGINS``: if set, load only these entry points ("" loads none).
- ``FORETELL_DISABLE_PLUGINS``: never load these.

A plugin contributing a name an earlier one holds (without a declared ``replaces=True`` of a
built-in) is disabled, named in a warning and in ``foretell plugins``; the earlier holder
keeps the name, so a third party never displaces a built-in it does not say it replaces.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from foretell import PLUGIN_API
from foretell.errors import ContributionConflict, PluginError
from foretell.plugin.hooks import Hooks, new_plugin_manager
from foretell.plugin.registry import Conflict, Contribution, Origin, Registrar, Registry

if sys.version_info >= (3, 12):
    from importlib import metadata as importlib_metadata
else:  # the stdlib backport lacks EntryPoint.dist before 3.12's API settled
    import importlib_metadata

GROUP = "foretell.plugins"
DISTRIBUTION = "foretell"
#: Core's own contributions (baseline KV codecs, single-file layout), registered first.
CORE_PLUGINS: tuple[str, ...] = ("foretell.plugin.baseline",)

LOADED, DISABLED, FAILED = "loaded", "disabled", "failed"

log = logging.getLogger("foretell.plugin")


@attrs.define
class PluginRecord:
    """What ``foretell plugins`` shows for one plugin."""

    name: str
    distribution: str | None
    version: str | None
    kind: str  # "core", "built-in" or "third-party"
    status: str = LOADED
    error: str | None = None
    exception: BaseException | None = attrs.field(default=None, repr=False, eq=False)
    contributions: list[Contribution] = attrs.Factory(list)
    source: str | None = None  # the entry point's value, e.g. "foretell_qwen"
    #: The conflicts that disabled this plugin (none when a switch did, or it loaded).
    conflicts: list[Conflict] = attrs.Factory(list)

    @property
    def origin(self) -> Origin:
        return Origin(
            plugin=self.name,
            distribution=self.distribution,
            version=self.version,
            builtin=self.kind != "third-party",
        )

    def fail(self, error: BaseException, what: str) -> None:
        self.status = FAILED
        self.exception = error
        self.error = f"{what}: {type(error).__name__}: {error}"
        self.contributions = []

    def disable(self, reason: str, conflicts: Sequence[Conflict] = ()) -> None:
        self.status = DISABLED
        self.error = reason
        self.conflicts = list(conflicts)
        self.contributions = []
        if conflicts:
            self.exception = ContributionConflict(reason)


@attrs.define(kw_only=True)
class PluginSwitches:
    allow: frozenset[str] | None = None
    block: frozenset[str] = frozenset()
    strict: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginSwitches:
        env = os.environ if env is None else env
        allow = env.get("FORETELL_LOAD_PLUGINS")
        return cls(
            allow=None if allow is None else _names(allow),
            block=_names(env.get("FORETELL_DISABLE_PLUGINS", "")),
            strict=env.get("FORETELL_STRICT_PLUGINS", "").lower() in ("1", "true", "yes"),
        )

    def permits(self, name: str) -> bool:
        return self.refusal(name) is None

    def refusal(self, name: str) -> str | None:
        """Why the switches keep entry point ``name`` unloaded, or None when they do not."""
        if name in self.block:
            return "FORETELL_DISABLE_PLUGINS names it; take it out of that list to use it"
        if self.allow is not None and name not in self.allow:
            return "FORETELL_LOAD_PLUGINS does not name it; add it to that list to use it"
        return None


def _names(value: str) -> frozenset[str]:
    return frozenset(n.strip() for n in value.split(",") if n.strip())


class PluginSet:
    """The loaded plugins of one runtime: their records, the registry, the plugin manager."""

    def __init__(self, switches: PluginSwitches | None = None):
        self.switches = switches or PluginSwitches()
        self.pm = new_plugin_manager()
        self.hooks = Hooks(self.pm)
        self.records: list[PluginRecord] = []
        self.registry = Registry()

    # -- loading -------------------------------------------------------------------------

    def load_core(self) -> None:
        for module_name in CORE_PLUGINS:
            record = PluginRecord(
                name=module_name.rpartition(".")[2],
                distribution=DISTRIBUTION,
                version=_version(DISTRIBUTION),
                kind="core",
                source=module_name,
            )
            self._admit(record, lambda m=module_name: importlib.import_module(m))

    def load_entry_points(self) -> None:
        seen: dict[str, PluginRecord] = {}
        for ep in _entry_points():
            dist = getattr(ep, "dist", None)
            dist_name = dist.metadata["Name"] if dist is not None else None
            record = PluginRecord(
                name=ep.name,
                distribution=dist_name,
                version=dist.version if dist is not None else None,
                kind="built-in" if _canonical(dist_name) == DISTRIBUTION else "third-party",
                source=ep.value,
            )
            if ep.name in seen:
                if seen[ep.name].distribution == dist_name:
                    continue  # the same distribution found twice on sys.path
                other = seen[ep.name]
                record.fail(
                    PluginError(
                        f"entry point name '{ep.name}' is already used by distribution "
                        f"{other.distribution} {other.version}; rename one of them"
                    ),
                    "cannot register",
                )
                self.records.append(record)
                continue
            seen[ep.name] = record
            refusal = self.switches.refusal(ep.name)
            if refusal is not None:
                record.disable(refusal)
                self.records.append(record)
                continue
            self._admit(record, ep.load)
        # The registry lists disabled and failed plugins too: rebuilt here as well, since a
        # plugin recorded after the last admitted one would otherwise be missing from it.
        self._rebuild_registry()
        self.check_strict()

    def register(self, plugin: Any, name: str, *, kind: str = "third-party",
                 distribution: str | None = None, version: str | None = None) -> PluginRecord:
        """Register a plugin object directly (tests, integrators composing a stack)."""
        record = PluginRecord(name=name, distribution=distribution, version=version, kind=kind)
        self._admit(record, lambda: plugin)
        return record

    def unregister(self, name: str) -> None:
        for record in [r for r in self.records if r.name == name]:
            self.records.remove(record)
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
        self._rebuild_registry()

    def check_strict(self) -> None:
        if not self.switches.strict:
            return
        problems = [f"plugin '{r.name}': {r.error}" for r in self.records if r.status == FAILED]
        problems += [c.message() for c in self.registry.conflicts.values()]
        if problems:
            raise PluginError("strict plugin loading failed:\n  " + "\n  ".join(problems))

    def _admit(self, record: PluginRecord, load: Any) -> None:
        self.records.append(record)
        try:
            plugin = load()
        except Exception as exc:
            record.fail(exc, f"import of '{record.source}' failed")
            record.error += _where(exc)
            self._rebuild_registry()
            return
        needs = getattr(plugin, "FORETELL_PLUGIN_API", 1)
        if isinstance(needs, int) and needs > PLUGIN_API:
            record.fail(
                PluginError(f"needs plugin API {needs}, this foretell provides {PLUGIN_API}"),
                "refused",
            )
            self._rebuild_registry()
            return
        try:
            self.pm.register(plugin, name=record.name)
        except Exception as exc:
            record.fail(exc, "invalid hook implementations")
            self._rebuild_registry()
            return
        collected: list[Contribution] = []
        try:
            for kind, call in self.hooks.registration_calls(record.name):
                call(register=Registrar(kind, record.origin, collected.append))
        except Exception as exc:
            self.pm.unregister(name=record.name)
            record.fail(exc, "a registration hook raised")
            record.error += _where(exc)
            self._rebuild_registry()
            return
        labels = [item.label for item in collected]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            self.pm.unregister(name=record.name)
            record.fail(PluginError(f"registers {', '.join(twice)} more than once"), "refused")
            self._rebuild_registry()
            return
        clashes = [c for c in map(self.registry.clash, collected) if c is not None]
        if clashes:
            # The earlier holder keeps its names: a newly installed plugin must not break
            # what ran before it came (a demo run selecting the built-in qwen3, say).
            self.pm.unregister(name=record.name)
            record.disable(" ".join(c.message() for c in clashes), clashes)
            log.warning("plugin '%s' is disabled: %s", record.name, record.error)
        else:
            record.contributions = collected
        self._rebuild_registry()

    def _rebuild_registry(self) -> None:
        registry = Registry()
        for record in self.records:
            for item in record.contributions:
                registry.add(item)
            for conflict in record.conflicts:
                registry.conflicts[(conflict.second.kind, conflict.second.name, record.name)] = (
                    conflict
                )
        registry.failures = [r for r in self.records if r.status == FAILED]
        registry.disabled = {r.name: r.error for r in self.records if r.status == DISABLED}
        self.registry = registry


def _where(exc: BaseException) -> str:
    """The plugin's own line that failed, skipping the import machinery's frozen frames."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    if not frames:
        return ""
    last = frames[-1]
    return f" ({last.filename}:{last.lineno})"


def _canonical(name: str | None) -> str | None:
    return name.lower().replace("_", "-") if name else None


def _version(distribution: str) -> str | None:
    try:
        return importlib_metadata.version(distribution)
    except importlib_metadata.PackageNotFoundError:
        return None


def _entry_points() -> Iterable[Any]:
    eps = list(importlib_metadata.entry_points(group=GROUP))
    # Built-ins first, then third parties; each sorted by name, so load order is stable.
    def order(ep: Any) -> tuple[int, str]:
        dist = getattr(ep, "dist", None)
        name = dist.metadata["Name"] if dist is not None else None
        return (0 if _canonical(name) == DISTRIBUTION else 1, ep.name)

    return sorted(eps, key=order)


def load_plugins(*, autoload: bool = True, switches: PluginSwitches | None = None) -> PluginSet:
    """Load core's plugins and, unless ``autoload`` is False, every permitted entry point."""
    plugins = PluginSet(switches or PluginSwitches.from_env())
    plugins.load_core()
    if autoload:
        plugins.load_entry_points()
    return plugins
