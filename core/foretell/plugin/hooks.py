"""The typed facade over pluggy: the only module that touches ``pm.hook``.

Call sites stay typed and greppable; pluggy's untyped ``pm.hook.<name>(...)`` lives here.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from foretell.plugin import hookspecs
from foretell.plugin.registry import Kind


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("foretell")
    pm.add_hookspecs(hookspecs)
    return pm


class Hooks:
    """Typed access to the registration hooks of one plugin manager."""

    def __init__(self, pm: pluggy.PluginManager):
        self.pm = pm

    def registration_calls(self, plugin_name: str) -> list[tuple[Kind, Callable[..., None]]]:
        """One callable per registration hook that ``plugin_name`` implements.

        Each takes the spec's arguments by keyword; calling plugins one at a time is what
        lets the loader stamp provenance on contributions and isolate a plugin that raises.
        """
        calls = []
        for kind in Kind:
            caller = getattr(self.pm.hook, kind.hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin_name == plugin_name:
                    calls.append((kind, _bind(impl)))
        return calls


def _bind(impl: pluggy.HookImpl) -> Callable[..., None]:
    def call(**kwargs: object) -> None:
        # pluggy lets an impl take fewer arguments than its spec; pass only those it names.
        impl.function(**{name: kwargs[name] for name in impl.argnames})

    return call
