"""templates/plugin generates a plugin distribution that installs against a local foretell
and passes its own tests, for every contribution kind.

Rendered with jinja2 the way copier does (``.jinja`` files and templated paths), so the
test needs no copier install. The fast case runs the generated tests from source; the
slow one installs the generated projects with pip into a fresh virtual environment that
sees this checkout's foretell (and nothing from an index), as the generated README says.
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


def render(target: Path, answers: dict) -> Path:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    for source in TEMPLATE.rglob("*"):
        if source.is_dir() or source.name == "copier.yml" or "__pycache__" in source.parts:
            continue
        rel = env.from_string(str(source.relative_to(TEMPLATE))).render(answers)
        out = target / rel.removesuffix(".jinja")
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
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.parametrize("contributes", KINDS)
def test_generated_plugin_tests_pass_from_source(tmp_path, contributes):
    given = answers(contributes)
    project = render(tmp_path / f"foretell-{given['plugin_name']}", given)
    entry = f'{given["plugin_name"]} = "{given["module_name"]}"'
    assert entry in (project / "pyproject.toml").read_text()
    done = run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project, env={**os.environ, "PYTHONPATH": str(project / "src")},
    )
    assert "passed" in done.stdout and "failed" not in done.stdout


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


@pytest.mark.slow
def test_following_the_generated_readme_installs_and_passes_in_a_fresh_venv(
    tmp_path, fresh_venv
):
    given = answers("draft")
    project = render(tmp_path / f"foretell-{given['plugin_name']}", given)
    commands = readme_commands(project)
    assert commands[0] == "pip install /path/to/foretell"
    bindir = fresh_venv.parent
    for command in commands:
        words = command.replace("/path/to/foretell", str(CHECKOUT)).replace("'", "").split()
        if words[0] == "pip":
            # --no-index: every requirement must be met locally; none may be fetched
            words = [str(fresh_venv), "-m", "pip", *words[1:2], "-q", "--no-index",
                     "--no-build-isolation", *words[2:]]
        elif words[0] == "foretell":
            words = [str(bindir / "foretell"), *words[1:]]
        else:
            words = [str(bindir / words[0]), *words[1:]]
        done = run(words, cwd=project)
        if words[-1] == "plugins":
            assert f"draft:{given['plugin_name']}" in done.stdout
    installed = run([str(fresh_venv), "-c", "import foretell; print(foretell.__file__)"])
    assert not installed.stdout.startswith(str(CHECKOUT / "core"))  # a real install, not the tree


@pytest.mark.slow
def test_generated_projects_of_every_kind_install_with_pip_and_pass_their_tests(
    tmp_path, fresh_venv
):
    if subprocess.run([str(fresh_venv), "-c", "import foretell"]).returncode != 0:
        # not yet installed there by the README test (run alone): the fast, editable way
        run([str(fresh_venv), "-m", "pip", "install", "-q", "--no-index",
             "--no-build-isolation", "-e", str(CHECKOUT)])
    projects = []
    for contributes in KINDS:
        given = answers(contributes)
        projects.append((given, render(tmp_path / f"foretell-{given['plugin_name']}", given)))
    for _, project in projects:
        run([str(fresh_venv), "-m", "pip", "install", "-q", "--no-index", "--no-build-isolation",
             "-e", f"{project}[test]"])
    listing = json.loads(run([str(fresh_venv), "-m", "foretell", "plugins", "--json"]).stdout)
    rows = {row["name"]: row for row in listing["plugins"]}
    for given, project in projects:
        row = rows[given["plugin_name"]]
        assert (row["kind"], row["status"]) == ("third-party", "loaded"), row
        assert [(c["kind"], c["name"]) for c in row["contributes"]] == [
            (given["contributes"], given["plugin_name"])
        ]
        done = run([str(fresh_venv), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
                   cwd=project)
        assert "passed" in done.stdout and "failed" not in done.stdout
