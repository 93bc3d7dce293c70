"""The hook specifications: the contract between foretell's core and its plugins.

Every hook here is a *registration* hook. It runs once, when plugins load, and receives a
``register`` callable (a :class:`foretell.plugin.Registrar`) instead of returning a list,
so the hook can grow keyword options without breaking plugins. None of these hooks is ever
called on a per-token path: the engine looks contributions up once, then calls the
objects their factories build.

A plugin is a module (or any object) with ``@foretell.hookimpl`` functions named after the
specs below, exposed through an entry point in the group ``foretell.plugins``. It may
declare ``FORETELL_PLUGIN_API = N``, the oldest plugin-API version it works with.

The hook reference in ``docs/reference/hooks.md`` is generated from these docstrings
(``python -m foretell.plugin.docgen``); a test fails when a spec lacks documentation or a test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from foretell.plugin.registry import Registrar

hookspec = pluggy.HookspecMarker("foretell")
hookimpl = pluggy.HookimplMarker("foretell")


@hookspec
def foretell_register_architectures(register: Registrar) -> None:
    """Contribute model architectures, keyed by the ``model_type`` of ``config.json``.

    Called once per plugin when plugins load, before any model is opened.

    :param register: call ``register(model_type, "package.module:builder", summary=...,
        config=None, min_api=1, replaces=False, synthetic=None, fallback=False)`` once per
        architecture. The factory is a ``"module:attr"`` string imported only when a model
        of that type is loaded; it must name a callable ``builder(config: dict) -> Model``
        that returns an object implementing :class:`foretell.model.Model`. ``synthetic``,
        also a ``"module:attr"`` string, names a :class:`foretell.tools.SyntheticSpec` (a
        tiny ``config.json``, named shapes, checkpoint quirks): with it, tests and
        ``foretell bench --synthetic`` make random-weight models of the architecture.
        ``fallback=True`` registers the type as a fallback: it serves the ``model_type``
        only where no other plugin registers it; a plugin that does (a native
        implementation) serves it instead, whatever the load order, with no conflict, and
        ``foretell plugins`` shows which plugin serves each type (the mlx-lm adapter
        registers every mlx-lm type this way). Two fallbacks of one name conflict as two
        native registrations do; a fallback cannot also ``replaces`` a built-in.
    :returns: nothing; contributions go through ``register``.
    """


@hookspec
def foretell_register_draft_providers(register: Registrar) -> None:
    """Contribute draft providers for speculative decoding, keyed by the ``[draft] kind``.

    Called once per plugin when plugins load.

    :param register: call ``register(kind, "package.module:Provider", config=ConfigCls,
        summary=..., min_api=1, replaces=False, fallback=False)``. ``config`` is a frozen
        attrs class; the rest of the ``[draft]`` section is structured into it (unknown keys
        are errors). The factory is imported only when a run selects this kind.
        ``fallback=True``: another plugin registering the same kind serves it instead, as
        for architectures.
    :returns: nothing; contributions go through ``register``.
    """


@hookspec
def foretell_register_cache_codecs(register: Registrar) -> None:
    """Contribute KV-cache codecs: how one kind of cache is snapshotted, stored and restored.

    Called once per plugin when plugins load. The codec's name is written into every stored
    cache entry and checked on load, so renaming a codec invalidates what it stored.

    :param register: call ``register(name, "package.module:Codec", summary=...,
        min_api=1, replaces=False, fallback=False)``; the factory builds an object with
        ``matches``, ``snapshot``, ``load``, ``clone``, ``header_trimmable`` and
        ``minimum_reusable_offset``. ``fallback=True``: another plugin registering the same
        name serves it instead, as for architectures.
    :returns: nothing; contributions go through ``register``.
    """


@hookspec
def foretell_register_storage_layouts(register: Registrar) -> None:
    """Contribute storage layouts for the SSD cache tier, keyed by the ``[cache] layout``.

    Called once per plugin when plugins load.

    :param register: call ``register(name, "package.module:Layout", config=ConfigCls,
        summary=..., min_api=1, replaces=False, schemes=(), fallback=False)``; the factory
        is called as ``Layout(root, config, *, identity=...)`` and builds a
        :class:`foretell.store.layout.StorageLayout` (atomic ``write``, verified ``read``,
        ``scan``, ``headers``, ``remove``, ``collect``, ``bytes``, ``key_for``). A layout
        that stores at URLs names their schemes (``schemes=("redis",)``): a cache location
        ``redis://host:6379/0`` then selects it, and ``root`` is that URL.
        ``fallback=True``: another plugin registering the same name serves it instead, as
        for architectures.
    :returns: nothing; contributions go through ``register``.
    """
