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
CORE = ROOT / "core" / "foretell"
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


def fenced_block(heading: str) -> str:
    """The first fenced block after the page's ``heading``."""
    return PAGE.split(f"\n{heading}\n", 1)[1].split("```\n", 2)[1]


def tree_entries() -> set[str]:
    """The top-level folders and modules "The folders" names (``cli/``, ``engine.py``)."""
    names = set()
    for line in fenced_block("## The folders").splitlines():
        if line and not line.startswith(" "):
            head = line.split("  ")[0]
            names.update(w for w in head.split() if w.endswith(("/", ".py")))
    return names


def path_steps() -> list[tuple[str, str]]:
    """``(module file, name)`` for each name the drawing of a request's path gives after a
    module (``engine.py Engine.encode_prompt``), read left to right up to its ``#`` comment."""
    steps, module = [], None
    for line in fenced_block("## One request's path").splitlines():
        for word in line.split("#", 1)[0].split():
            if word.endswith(".py"):
                module = word
            elif module and re.fullmatch(r"[A-Za-z_]\w*(\.\w+)?", word):
                steps.append((module, word))
        module = None
    return steps


def _defines_at_top(path: Path, dotted: str) -> bool:
    """Whether ``path`` defines ``Name`` (or ``Class.member``) at its top level."""
    name, _, member = dotted.partition(".")
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            return not member or any(getattr(n, "name", None) == member for n in node.body)
    return False


def test_the_drawn_path_names_what_each_module_defines():
    """Every step of the request's path names a module that exists and a function or class
    that module defines: moving or renaming one fails here until the drawing follows."""
    steps = path_steps()
    assert ("engine.py", "Engine.encode_prompt") in steps and len(steps) > 20
    wrong = [f"{module} {name}" for module, name in steps
             if not (CORE / module).is_file() or not _defines_at_top(CORE / module, name)]
    assert wrong == []


def test_core_holds_what_the_tree_names():
    present = {
        p.name + ("/" if p.is_dir() else "")
        for p in CORE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or p.suffix == ".py"
    } - {"__init__.py", "__main__.py"}
    assert present == tree_entries()
    assert {"engine.py", "request.py", "stream.py", "tools/"} <= tree_entries()


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


#: The engine's parts below the request loop (docs/layout.md draws the path through them).
PARTS = ("spec", "cache", "store", "model", "plugin", "platform")
#: The request loop: it calls the parts; they never call back up into it.
REQUEST_LOOP = ("foretell.engine", "foretell.request", "foretell.stream", "foretell.scheduler",
                "foretell.batch_step")
#: What measures or drives the engine from outside; the engine never imports it.
NOT_ENGINE = ("foretell.tools", "foretell.cli")
#: The longest a module of the engine may be (tools/ measures and is exempt).
MAX_LINES = 600


def _runtime_imports(path: Path) -> set[str]:
    """What ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks left out): each
    module, and ``module.name`` for each ``from module import name`` (``from foretell
    import engine`` reaches ``foretell.engine``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _reaching(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in _runtime_imports(path)
                  if any(m == p or m.startswith(p + ".") for p in prefixes))


def _engine_modules() -> list[Path]:
    """Every module of core/foretell but tools/ and cli/ (and ``__main__``, the CLI's)."""
    return sorted(p for p in CORE.rglob("*.py")
                  if p.relative_to(CORE).parts[0] not in ("tools", "cli")
                  and p.name != "__main__.py")


def test_the_checks_see_the_whole_engine():
    names = {str(p.relative_to(CORE)) for p in _engine_modules()}
    assert {"engine.py", "spec/verifier.py", "cache/tier.py", "plugin/loader.py"} <= names
    assert not any(n.startswith(("tools/", "cli/")) for n in names)
    assert "foretell.request" in _reaching(CORE / "engine.py", ("foretell.request",))


@pytest.mark.parametrize("part", PARTS)
def test_the_parts_below_the_request_loop_never_import_it(part):
    """The request loop (engine.py, request.py, stream.py) sits above spec/, cache/ and what
    they build on: it calls them, they never call back up into it. Every module of the part
    counts, subpackages included."""
    offenders = {str(path.relative_to(CORE)): _reaching(path, REQUEST_LOOP)
                 for path in sorted((CORE / part).rglob("*.py"))}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_the_engine_never_imports_the_tools_or_the_cli():
    """tools/ (what ``foretell bench`` runs) and cli/ drive the engine from the top; nothing
    the engine runs imports them, so measuring code never becomes part of serving."""
    offenders = {str(path.relative_to(CORE)): _reaching(path, NOT_ENGINE)
                 for path in _engine_modules()}
    assert {name: mods for name, mods in offenders.items() if mods} == {}


def test_no_measuring_code_sits_inside_the_engine():
    """Benchmarks and probes live in tools/ (what ``foretell bench`` runs) or the top-level
    benchmarks/ (what a maintainer reruns), never beside the part they measure."""
    measuring = [
        str(path.relative_to(CORE)) for path in _engine_modules()
        if any(word in path.stem for word in ("bench", "probe"))
        or "not a test" in (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
                            or "").lower()
    ]
    assert measuring == []


def test_no_engine_module_is_over_600_lines():
    """A module a newcomer reads in one sitting; tools/ measures and is exempt."""
    long = {str(path.relative_to(CORE)): n for path in _engine_modules()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}
