"""The server sits above the engine, as the CLI does: no module of the engine (anything in
core/foretell but serve/ and cli/) imports it, at run time or lazily inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core" / "foretell"


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_nothing_below_the_server_imports_it():
    below = [p for p in CORE.rglob("*.py") if p.relative_to(CORE).parts[0] not in ("serve", "cli")]
    assert len(below) > 50
    offenders = {str(p.relative_to(CORE)): sorted(m for m in imports_of(p)
                                                  if m == "foretell.serve"
                                                  or m.startswith("foretell.serve."))
                 for p in below}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_the_server_never_imports_the_cli():
    offenders = {str(p.relative_to(CORE)): sorted(m for m in imports_of(p)
                                                  if m.startswith("foretell.cli"))
                 for p in (CORE / "serve").rglob("*.py")}
    assert {name: mods for name, mods in offenders.items() if mods} == {}
