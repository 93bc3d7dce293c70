"""Old path of :mod:`foretell.tools.synthetic`, kept so existing imports work.

Unlike the other old paths this one forwards names instead of being the same module:
tests/models/test_synthetic_specs.py finds core's tool sources next to this file's
``__file__`` (docs/decisions.md, "Old module paths").
"""

from typing import Any

from foretell.tools import synthetic as _synthetic


def __getattr__(name: str) -> Any:
    return getattr(_synthetic, name)
