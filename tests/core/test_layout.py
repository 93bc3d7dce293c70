"""docs/layout.md holds: every name its public-surface table lists resolves from that package,
importing those packages loads no MLX, every old module path is the moved module itself,
and the architecture plugins import foretell only through the documented surface.

The tables are read from the page, so a name added to the page without the code (or an old
path dropped from the code while the page still lists it) fails here.
"""

from __future__ import annotations

import ast
import importlib
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


def old_paths() -> list[tuple[str, str]]:
    """``(old, now)`` module pairs from the "Old path | Now" table; ``<same name>`` expanded.
    The row for the old ``foretell.model`` module (now a package) is the table's only
    non-alias row and is skipped."""
    pairs = []
    for old, now in table("| Old path | Now |"):
        (target,) = re.findall(r"`([^`]+)`", now)[:1]
        for module in MODULE.findall(old):
            if module == "foretell.model":
                continue
            same = module.rsplit(".", 1)[1]
            pairs.append((module, target.replace("<same name>", same)))
    return pairs


def test_the_tables_are_read_from_the_page():
    assert {"foretell", "foretell.model", "foretell.plugin", "foretell.tools"} <= set(surface())
    assert "make_rope" in surface()["foretell.model"]
    assert ("foretell.plugins", "foretell.plugin.loader") in old_paths()
    assert ("foretell.kvcache", "foretell.model.kvcache") in old_paths()


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


@pytest.mark.parametrize(("old", "now"), old_paths(), ids=lambda p: p)
def test_an_old_module_path_is_the_moved_module_itself(old, now):
    assert importlib.import_module(old) is importlib.import_module(now)


def foretell_imports(path: Path) -> set[str]:
    """The foretell modules a source file imports (at any depth: lazy imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "foretell" or m.startswith("foretell.")}


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


def test_core_holds_what_the_tree_names_plus_the_old_path_shims():
    core = ROOT / "core" / "foretell"
    shims = {old.removeprefix("foretell.") + ".py" for old, _ in old_paths()}
    present = {
        p.name + ("/" if p.is_dir() else "")
        for p in core.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    } - {"__init__.py", "__main__.py"}
    assert present - shims == tree_entries()
    for shim in present & shims:
        assert "sys.modules[__name__] =" in (core / shim).read_text(), f"{shim} is not a shim"


def test_no_shipped_code_imports_an_old_module_path():
    old = {module for module, _ in old_paths()}
    shims = {ROOT / "core" / "foretell" / (m.removeprefix("foretell.") + ".py") for m in old}
    sources = [p for top in ("core", "plugins", "contrib") for p in (ROOT / top).rglob("*.py")
               if p not in shims and "build" not in p.parts]
    assert len(sources) > 50
    used = {f"{p.relative_to(ROOT)}: {m}" for p in sources for m in imported_names(p) & old}
    assert used == set(), "import the new path (docs/layout.md)"


def imported_names(path: Path) -> set[str]:
    """Modules a file imports, and ``package.name`` for each ``from package import name``
    (which may be a module: ``from foretell import synthetic``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


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
