"""The public surface's one mechanism: a package names what it exports and the module each
name lives in, and each name resolves on first use. So importing a package imports none of
its modules (no MLX before the CPU's BLAS is bound, docs/blas.md), and moving a module
inside it changes one table entry (docs/layout.md)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``, whose names live in the modules ``where``
    gives; a resolved name is kept in the package, so it resolves once."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__, sorted(where)
