"""docs/layout.md holds: every name its public-surface table lists resolves from that package,
importing those packages loads no MLX, the architecture plugins import foretell only through
the documented surface, and every foretell module or name any source imports exists.

The tables are read from the page, so a name added to the page without the code fails here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
IDENTIFIER = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")
MODULE = re.compile(r"`(foretell(?:\.[a-z_]+)*)`")


def table(header: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header row starts with ``header``."""
    lines = PAGE.split(header, 1)[1].splitlines()[2:]  # past the header and the rule
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def surface() -> dict[str, list[str]]:
    """``{package: [names]}`` from the "Import from | Names" table."""
    return {
        MODULE.search(package).group(1): IDENTIFIER.findall(names)
        for package, names in table("| Import from | Names |")
    }


def surface_modules() -> set[str]:
    """The packages of the table plus the modules the page lists "rather than names"."""
    listed = PAGE.split("Modules rather than names:", 1)[1].split("\n\n", 1)[0]
    return set(surface()) | set(MODULE.findall(listed))


def test_the_tables_are_read_from_the_page():
    assert {"foretell", "foretell.model", "foretell.plugin", "foretell.tools"} <= set(surface())
    assert "make_rope" in surface()["foretell.model"]


@pytest.mark.parametrize("package", sorted(surface()))
def test_every_listed_name_resolves_from_its_package(package):
    module = importlib.import_module(package)
    missing = [name for name in surface()[package] if not hasattr(module, name)]
    assert missing == [], f"docs/layout.md lists {missing} under {package}"


def test_importing_the_public_packages_loads_no_mlx():
    code = (
        "import importlib, json, sys\n"
        f"for name in {sorted(surface())!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


PLUGIN_DIRS = sorted(p for p in (ROOT / "plugins").iterdir() if (p / "__init__.py").exists())
PLUGIN_DIRS += [ROOT / "contrib" / "foretell-ngram" / "foretell_ngram"]


def off_surface(path: Path, allowed: set[str]) -> set[str]:
    """The foretell imports of ``path`` that reach neither a listed package nor a listed
    module (``from foretell.platform import blas`` reaches the listed module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            module, names = node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            module, names = None, [a.name for a in node.names]
        else:
            continue
        for name in names:
            target = f"{module}.{name}" if module else name
            reached = module if module else name
            if reached.split(".")[0] == "foretell" and not {reached, target} & allowed:
                found.add(target if module in allowed else reached)
    return found


def test_every_plugin_directory_is_checked():
    names = {p.name for p in PLUGIN_DIRS}
    assert {"foretell_qwen", "foretell_gemma", "foretell_two_model", "foretell_blockstore",
            "foretell_ngram"} <= names


@pytest.mark.parametrize("plugin", PLUGIN_DIRS, ids=lambda p: p.name)
def test_plugins_import_foretell_only_through_the_public_surface(plugin):
    allowed = surface_modules()
    used = {
        f"{source.relative_to(ROOT)}: {module}"
        for source in plugin.rglob("*.py")
        for module in off_surface(source, allowed)
    }
    assert used == set(), "import these through a package or module docs/layout.md lists"


def tree_entries() -> set[str]:
    """The top-level folders and modules the page's tree names (``cli/``, ``generate.py``)."""
    tree = PAGE.split("```\n", 2)[1]
    names = set()
    for line in tree.splitlines():
        if line and not line.startswith(" "):
            head = line.split("  ")[0]
            names.update(w for w in head.split() if w.endswith(("/", ".py")))
    return names


def test_core_holds_what_the_tree_names():
    core = ROOT / "core" / "foretell"
    present = {
        p.name + ("/" if p.is_dir() else "")
        for p in core.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    } - {"__init__.py", "__main__.py"}
    assert present == tree_entries()


SOURCES = [
    p
    for top in ("core", "plugins", "contrib", "tests", "benchmarks")
    for p in (ROOT / top).rglob("*.py")
    if "build" not in p.parts
]


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _defines(module: str, name: str) -> bool:
    """Whether ``from module import name`` finds something: a submodule or an attribute."""
    if not _exists(module):
        return False
    return _exists(f"{module}.{name}") or hasattr(importlib.import_module(module), name)


def test_every_foretell_module_and_name_a_source_imports_exists():
    """Imports inside functions run late: one of a module that moved or went (an old alias
    path) fails here instead of when that function first runs."""
    assert len(SOURCES) > 100
    missing = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "foretell":
                    missing |= {
                        f"{path.relative_to(ROOT)}: from {node.module} import {alias.name}"
                        for alias in node.names
                        if not _defines(node.module, alias.name)
                    }
            elif isinstance(node, ast.Import):
                missing |= {
                    f"{path.relative_to(ROOT)}: import {alias.name}"
                    for alias in node.names
                    if alias.name.split(".")[0] == "foretell"
                    and not _exists(alias.name)
                }
    assert missing == set()


#: Measuring tools kept beside what they measure; they drive the engine from the top.
TOOLS_BESIDE_THEIR_PART = {"bench.py", "probe.py", "restore_probe.py", "round_probe.py"}


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks left out)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.ImportFrom) and child.module:
                found.add(child.module)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


@pytest.mark.parametrize("part", ["spec", "cache", "store", "model"])
def test_the_parts_below_the_request_loop_never_import_it(part):
    """The request loop (engine.py, request.py, stream.py) sits above spec/ and cache/ (and
    what they build on): it calls them, they never call back up into it."""
    loop = ("foretell.engine", "foretell.request", "foretell.stream")
    offenders = {
        path.name: sorted(m for m in _runtime_imports(path) if m.startswith(loop))
        for path in sorted((ROOT / "core" / "foretell" / part).glob("*.py"))
        if path.name not in TOOLS_BESIDE_THEIR_PART
    }
    assert {name: mods for name, mods in offenders.items() if mods} == {}
