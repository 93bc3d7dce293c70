"""Contributions and the registry that holds them.

A contribution is a frozen descriptor: what a plugin offers for one extension point, with a
lazily imported factory, so listing plugins never imports a heavy dependency.
"""

from __future__ import annotations

import enum
import importlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from foretell import PLUGIN_API
from foretell.errors import PluginError, UnknownContribution


class Kind(str, enum.Enum):
    """The four extension points; the value is what ``foretell plugins`` prints."""

    ARCHITECTURE = "architecture"
    DRAFT = "draft"
    CODEC = "codec"
    LAYOUT = "layout"

    @property
    def hook_name(self) -> str:
        return {
            Kind.ARCHITECTURE: "foretell_register_architectures",
            Kind.DRAFT: "foretell_register_draft_providers",
            Kind.CODEC: "foretell_register_cache_codecs",
            Kind.LAYOUT: "foretell_register_storage_layouts",
        }[self]


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
#: A URL scheme a layout may claim (foretell.store.layout.url_scheme reads it from a location).
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+$")


@attrs.frozen(kw_only=True)
class Origin:
    """Which plugin a contribution came from, stamped by the core, not by the plugin."""

    plugin: str
    distribution: str | None = None
    version: str | None = None
    builtin: bool = False

    def describe(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else "no distribution"
        return f"plugin '{self.plugin}' ({dist})"


@attrs.frozen(kw_only=True)
class Contribution:
    """One named implementation of one extension point."""

    kind: Kind
    name: str
    factory: str
    config: type | None = None
    summary: str = ""
    min_api: int = 1
    replaces: bool = False
    #: A fallback serves its name only where no other plugin registers that name: a native
    #: implementation, whichever plugin and load order, wins without a conflict (the mlx-lm
    #: adapter registers every mlx-lm ``model_type`` this way).
    fallback: bool = False
    #: Architectures only: ``"module:attr"`` naming a :class:`foretell.tools.SyntheticSpec`,
    #: how to make a tiny random-weight checkpoint of this architecture for tests and bench.
    synthetic: str | None = None
    #: Layouts only: the URL schemes whose cache locations this layout stores at
    #: (``redis`` for ``--cache-dir redis://host:6379/0``); empty: a directory's.
    schemes: tuple[str, ...] = ()
    origin: Origin

    @property
    def label(self) -> str:
        return f"{self.kind.value}:{self.name}"

    def load(self) -> Any:
        """Import and return the factory object; errors name the plugin."""
        return self._import(self.factory, "factory")

    def load_synthetic(self) -> Any:
        """Import and return the synthetic-checkpoint spec (None if it registered none)."""
        return None if self.synthetic is None else self._import(self.synthetic, "synthetic spec")

    def _import(self, ref: str, what: str) -> Any:
        module_name, _, attr = ref.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:
            raise PluginError(
                f"{self.label} from {self.origin.describe()}: cannot import its {what} "
                f"'{ref}': {type(exc).__name__}: {exc}"
            ) from exc
        return obj


class Registrar:
    """The ``register`` callable a registration hook receives, bound to one plugin and kind."""

    def __init__(self, kind: Kind, origin: Origin, sink: Callable[[Contribution], None]):
        self._kind = kind
        self._origin = origin
        self._sink = sink

    def __call__(
        self,
        name: str,
        factory: str,
        *,
        config: type | None = None,
        summary: str = "",
        min_api: int = 1,
        replaces: bool = False,
        synthetic: str | None = None,
        schemes: tuple[str, ...] | list[str] = (),
        fallback: bool = False,
    ) -> None:
        where = f"{self._origin.describe()} registering {self._kind.value} '{name}'"
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where}: the name must be a non-empty string")
        if not isinstance(factory, str) or not _FACTORY.match(factory):
            raise PluginError(f"{where}: factory must be a 'module:attr' string, got {factory!r}")
        if synthetic is not None:
            if self._kind is not Kind.ARCHITECTURE:
                raise PluginError(f"{where}: synthetic= is for architectures only")
            if not isinstance(synthetic, str) or not _FACTORY.match(synthetic):
                raise PluginError(
                    f"{where}: synthetic must be a 'module:attr' string, got {synthetic!r}"
                )
        if not isinstance(fallback, bool) or (fallback and replaces):
            raise PluginError(f"{where}: fallback must be True or False, and a fallback "
                              "cannot also replace a built-in")
        if config is not None and not attrs.has(config):
            raise PluginError(f"{where}: config must be an attrs class, got {config!r}")
        if schemes:
            if self._kind is not Kind.LAYOUT:
                raise PluginError(f"{where}: schemes= is for storage layouts only")
            if isinstance(schemes, str) or not all(
                    isinstance(s, str) and _SCHEME.match(s) for s in schemes):
                raise PluginError(f"{where}: schemes must be a list of URL schemes such as "
                                  f"['redis'], got {schemes!r}")
        if min_api > PLUGIN_API:
            raise PluginError(
                f"{where}: needs plugin API {min_api}, this foretell provides {PLUGIN_API}; "
                "upgrade foretell or install an older version of the plugin"
            )
        self._sink(
            Contribution(
                kind=self._kind,
                name=name,
                factory=factory,
                config=config,
                summary=summary,
                min_api=min_api,
                replaces=replaces,
                fallback=fallback,
                synthetic=synthetic,
                schemes=tuple(s.lower() for s in schemes),
                origin=self._origin,
            )
        )


@attrs.define
class Conflict:
    """Two plugins contribute one name: ``first`` (loaded earlier) keeps it, the plugin of
    ``second`` is disabled."""

    first: Contribution
    second: Contribution

    def message(self) -> str:
        holder, newcomer = self.first.origin, self.second.origin.plugin
        head = (
            f"{self.first.label} is contributed by both {holder.describe()} and "
            f"{self.second.origin.describe()}; plugin '{newcomer}', loaded later, is disabled "
            f"and '{holder.plugin}' keeps the name."
        )
        if holder.builtin:
            fix = "A plugin meant to replace a built-in registers with replaces=True"
        else:
            fix = (
                f"To use '{newcomer}' instead, disable '{holder.plugin}' with "
                f"FORETELL_DISABLE_PLUGINS={holder.plugin}"
            )
        return f"{head} {fix}; FORETELL_DISABLE_PLUGINS={newcomer} silences this."


@attrs.define
class Replacement:
    winner: Contribution
    replaced: Contribution


@attrs.define
class Shadowed:
    """A fallback's name that a native contribution holds: ``native`` serves it."""

    native: Contribution
    fallback: Contribution


class Registry:
    """Every loaded contribution, by kind and name; the only place the engine looks them up."""

    def __init__(self) -> None:
        self._items: dict[tuple[Kind, str], Contribution] = {}
        #: Names a later plugin also claimed, keyed by (kind, name, that plugin): the
        #: earlier holder keeps the name and the later plugin is disabled.
        self.conflicts: dict[tuple[Kind, str, str], Conflict] = {}
        self.replacements: list[Replacement] = []
        #: Fallbacks whose names a native contribution serves instead.
        self.shadowed: list[Shadowed] = []
        #: Filled by the loader: plugins that failed, consulted when a lookup misses.
        self.failures: list[Any] = []
        #: Filled by the loader: installed plugins that are not loaded, with why.
        self.disabled: dict[str, str] = {}

    def add(self, item: Contribution) -> None:
        """Add ``item``. A name already held stays with its holder and the clash is recorded
        (the loader disables a clashing plugin before it gets here)."""
        key = (item.kind, item.name)
        conflict = self.clash(item)
        if conflict is not None:
            self.conflicts[(*key, item.origin.plugin)] = conflict
            return
        current = self._items.get(key)
        if current is None:
            self._items[key] = item
        elif item.fallback != current.fallback:
            native, fallback = (current, item) if item.fallback else (item, current)
            self._items[key] = native
            self.shadowed.append(Shadowed(native=native, fallback=fallback))
        elif _replaces(item, current):
            self._items[key] = item
            self.replacements.append(Replacement(winner=item, replaced=current))
        else:  # ``current`` replaced ``item`` before ``item`` arrived
            self.replacements.append(Replacement(winner=current, replaced=item))

    def clash(self, item: Contribution) -> Conflict | None:
        """The conflict adding ``item`` would make, or None when its name is free or the
        two are a declared replacement of a built-in."""
        current = self._items.get((item.kind, item.name))
        if (current is None or current.fallback != item.fallback or _replaces(item, current)
                or _replaces(current, item)):
            return None
        return Conflict(first=current, second=item)

    def __iter__(self) -> Iterator[Contribution]:
        return iter(self._items.values())

    def names(self, kind: Kind) -> list[str]:
        return sorted(name for k, name in self._items if k is kind)

    def served_by(self, kind: Kind) -> dict[str, Contribution]:
        """``{name: the contribution a run selecting it gets}`` for ``kind``: natives over
        fallbacks, as :meth:`get` resolves them."""
        return {name: self._items[(kind, name)] for name in self.names(kind)}

    def layout_for(self, location: Any) -> Contribution | None:
        """The storage layout registered for the scheme of ``location`` when it is a URL
        (``redis://host:6379/0``: the one with ``schemes=("redis",)``); None for a directory.

        :raises UnknownContribution: a URL no installed layout serves, or one two layouts
            claim (naming both).
        """
        from foretell.store.layout import url_scheme

        scheme = url_scheme(location)
        if scheme is None:
            return None
        serving = [c for c in self if c.kind is Kind.LAYOUT and scheme in c.schemes]
        if len(serving) == 1:
            return serving[0]
        if serving:
            raise UnknownContribution(
                f"{scheme}:// URLs are claimed by two storage layouts: "
                + " and ".join(f"'{c.name}' of {c.origin.describe()}" for c in serving)
                + f"; disable one with FORETELL_DISABLE_PLUGINS={serving[-1].origin.plugin}")
        known = sorted({s for c in self if c.kind is Kind.LAYOUT for s in c.schemes})
        message = (f"no storage layout stores at {scheme}:// URLs (installed layouts serve "
                   f"{', '.join(f'{s}://' for s in known) or 'directories only'}); install "
                   f"the plugin that does (foretell-redis for redis://), see `foretell plugins`")
        failed = [f for f in self.failures if f.error is not None]
        if failed:
            message += "; " + "; ".join(f"plugin '{f.name}' failed to load: {f.error}"
                                        for f in failed)
        raise UnknownContribution(message)

    def get(self, kind: Kind, name: str) -> Contribution:
        """The contribution selected by ``name``; errors explain why it is not available."""
        found = self._items.get((kind, name))
        if found is not None:
            return found
        installed = ", ".join(self.names(kind)) or "none"
        if name in self.disabled:
            raise UnknownContribution(
                f"{kind.value} '{name}': plugin '{name}' is installed but disabled: "
                f"{self.disabled[name]}"
            )
        message = f"no {kind.value} named '{name}' is installed (installed: {installed})"
        if self.disabled:
            # Its contributions are unknown until it loads; one of them may be this name.
            message += (
                f"; disabled plugins, which may provide it: {', '.join(sorted(self.disabled))}"
            )
        failed = [f for f in self.failures if f.error is not None]
        if failed:
            # The selected name may belong to a plugin that failed: surface its own error.
            first = failed[0]
            details = "; ".join(f"plugin '{f.name}' failed to load: {f.error}" for f in failed)
            raise UnknownContribution(f"{message}; {details}") from first.exception
        hint = {
            Kind.ARCHITECTURE: "install a plugin that provides this model_type",
            Kind.DRAFT: "install a plugin that provides this draft kind",
            Kind.CODEC: "install a plugin that provides this codec",
            Kind.LAYOUT: "install a plugin that provides this storage layout",
        }[kind]
        raise UnknownContribution(f"{message}; {hint} (see `foretell plugins`)")


def _replaces(new: Contribution, old: Contribution) -> bool:
    """A third party may take a built-in's name only by saying so (``replaces=True``)."""
    return new.replaces and old.origin.builtin and not new.origin.builtin
