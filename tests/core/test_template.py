"""templates/plugin generates a working plugin of every contribution kind whose own tests
run foretell's conformance suite for that kind; each is installed into a fresh environment
(nothing from an index), its tests pass there, and ``foretell plugins`` lists it.

Rendered with jinja2 the way copier does (``.jinja`` files, templated paths, a file whose
name renders empty is left out), so the test needs no copier install. Each kind is rendered,
installed and tested once: the draft kind by following its generated README step by step,
the others with pip into the same environment.
"""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import jinja2
import pytest

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "plugin"
KINDS = ["draft", "codec", "layout", "architecture"]
#: The module each kind's contribution lives in, and the suite its generated tests call.
MODULES = {"draft": "drafter", "codec": "codec", "layout": "layout",
           "architecture": "architecture"}
SUITES = {"draft": "check_draft_provider", "codec": "check_cache_codec",
          "layout": "check_storage_layout", "architecture": "check_architecture"}


def render(target: Path, answers: dict) -> Path:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    for source in TEMPLATE.rglob("*"):
        if source.is_dir() or source.name == "copier.yml" or "__pycache__" in source.parts:
            continue
        rel = env.from_string(str(source.relative_to(TEMPLATE))).render(answers)
        out = target / rel.removesuffix(".jinja")
        if Path(rel).name == ".jinja":
            continue  # copier skips a file whose name renders empty: another kind's module
        out.parent.mkdir(parents=True, exist_ok=True)
        text = source.read_text(encoding="utf-8")
        out.write_text(env.from_string(text).render(answers) if source.suffix == ".jinja" else text)
    return target


def answers(contributes: str) -> dict:
    name = f"my-{contributes}"
    return {
        "plugin_name": name,
        "module_name": f"foretell_{name.replace('-', '_')}",
        "description": "A test plugin",
        "contributes": contributes,
    }


def run(cmd, **kwargs):
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.parametrize("contributes", KINDS)
def test_each_kind_renders_its_own_module_and_a_one_line_conformance_test(tmp_path, contributes):
    given = answers(contributes)
    project = render(tmp_path / "p", given)
    package = project / "src" / given["module_name"]
    assert sorted(p.name for p in package.iterdir()) == sorted(
        ["__init__.py", f"{MODULES[contributes]}.py"])
    entry = f'{given["plugin_name"]} = "{given["module_name"]}"'
    assert entry in (project / "pyproject.toml").read_text()
    conformance = (project / "tests" / "test_conformance.py").read_text()
    assert [line.strip().split("(")[0] for line in conformance.splitlines()
            if SUITES[contributes] + "(" in line] == [SUITES[contributes]]
    # The generated code is what a plugin author starts from: it lints clean.
    # (ruff's default rules: the project's own config, which excludes templates/, is not read)
    run([sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "E,F,W",
         "--target-version", "py310", "--line-length", "100", str(project)])


def test_a_generated_plugin_that_breaks_its_contract_fails_its_own_tests(tmp_path):
    """The generated tests can fail: a codec claiming every cache is caught by its suite."""
    given = answers("codec")
    project = render(tmp_path / "p", given)
    codec = project / "src" / given["module_name"] / "codec.py"
    text = codec.read_text()
    assert "return type(cache) is TightKVCache" in text
    codec.write_text(text.replace("return type(cache) is TightKVCache", "return True"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_conformance.py"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "matches() claims an arbitrary object" in done.stdout


def test_a_generated_drafter_whose_restore_loses_its_state_fails_its_own_tests(tmp_path):
    """The generated drafter captures and restores its state, and its tests check the round
    trip: a restore that drops the stored history is caught."""
    given = answers("draft")
    project = render(tmp_path / "p", given)
    drafter = project / "src" / given["module_name"] / "drafter.py"
    text = drafter.read_text()
    assert "    return stored\n" in text
    drafter.write_text(text.replace("    return stored\n", "    return []\n"))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_conformance.py"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(project / "src")},
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "a source restored from capture() drafts other tokens" in done.stdout


#: This checkout's own install in the dev environment, hidden from the fresh one: the
#: README's first step must install foretell there itself.
OWN_FILES = ("foretell-", "__editable__.foretell-", "__editable___foretell_0")
CHECKOUT = TEMPLATE.parents[1]


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new virtual environment that sees this environment's packages except foretell
    itself (so nothing comes from an index), the way --system-site-packages shows a
    system's: through a .pth file naming a directory of links to them."""
    root = tmp_path_factory.mktemp("venv")
    shared = root / "shared-site"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(OWN_FILES):
            (shared / entry.name).symlink_to(entry)
    venv = root / "fresh"
    run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    # addsitedir, not a bare path: the linked packages' own .pth files run too
    Path(site.stdout.strip(), "shared_site.pth").write_text(
        f"import site; site.addsitedir({str(shared)!r})\n"
    )
    done = subprocess.run([str(python), "-c", "import foretell"], capture_output=True)
    assert done.returncode != 0, "foretell must not be importable before the README's step 1"
    return python


def readme_commands(project: Path) -> list[str]:
    """The generated README's install-and-test block, one shell command per line."""
    text = (project / "README.md").read_text()
    block = text.split("```\n")[1]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.split("#")[0].strip()]


def pip_offline(python: Path, *args: str) -> list[str]:
    # --no-index: every requirement must be met locally; none may be fetched
    return [str(python), "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
            *args]


@pytest.mark.slow
def test_every_kind_installs_into_a_fresh_venv_passes_its_tests_and_is_listed(
    tmp_path, fresh_venv
):
    """The draft kind by following its generated README (foretell installed first, as a
    stranger would), then each other kind with pip into that environment; every project's
    tests (its conformance suite) pass against the installed copies, run once each."""
    bindir = fresh_venv.parent
    given = answers("draft")
    project = render(tmp_path / f"foretell-{given['plugin_name']}", given)
    commands = readme_commands(project)
    assert commands[0] == "pip install /path/to/foretell"
    ran = set()
    for command in commands:
        words = command.replace("/path/to/foretell", str(CHECKOUT)).replace("'", "").split()
        if words[0] == "pip":
            words = pip_offline(fresh_venv, *words[2:])
        else:
            words = [str(bindir / words[0]), *words[1:]]
        done = run(words, cwd=project)
        ran.add(words[-1])
        if words[-1] == "plugins":
            assert f"draft:{given['plugin_name']}" in done.stdout
        if words[-1] == "pytest":
            assert "passed" in done.stdout and "failed" not in done.stdout
    assert {"plugins", "pytest"} <= ran, commands
    installed = run([str(fresh_venv), "-c", "import foretell; print(foretell.__file__)"])
    assert not installed.stdout.startswith(str(CHECKOUT / "core"))  # a real install, not the tree

    others = []
    for contributes in KINDS[1:]:
        given = answers(contributes)
        others.append((given, render(tmp_path / f"foretell-{given['plugin_name']}", given)))
    run(pip_offline(fresh_venv, *[arg for _, project in others for arg in ("-e", f"{project}[test]")]))
    listing = json.loads(run([str(bindir / "foretell"), "plugins", "--json"]).stdout)
    rows = {row["name"]: row for row in listing["plugins"]}
    for contributes in KINDS:
        name = answers(contributes)["plugin_name"]
        row = rows[name]
        assert (row["kind"], row["status"]) == ("third-party", "loaded"), row
        assert [(c["kind"], c["name"]) for c in row["contributes"]] == [(contributes, name)]
    for _, project in others:
        done = run([str(fresh_venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                   cwd=project)
        assert "passed" in done.stdout and "failed" not in done.stdout
