"""Every `pip install` line the docs give can work from a checkout: foretell and its plugins
are not on PyPI, so they are installed by path, never by name; a path names something in
the repository; an extra (`.[bench]`) is one pyproject.toml declares."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "contrib").glob("*/README.md"),
     *(ROOT / "templates").rglob("README.md.jinja")]
)
COMMAND = re.compile(r"pip install ([^`\n#&;]*)")
TAKES_A_VALUE = {"--index-url", "--extra-index-url", "--target", "-r", "-c"}
#: How the docs write "the checkout": the user substitutes their own path.
PLACEHOLDER = "/path/to/foretell"


def install_targets(text: str) -> list[str]:
    targets = []
    for match in COMMAND.finditer(text):
        words = iter(match.group(1).split())
        for word in words:
            if word in TAKES_A_VALUE:
                next(words, None)
            elif not word.startswith("-"):
                targets.append(word.strip("'\"()"))
    return targets


def checkout_extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return set(project["optional-dependencies"])


def problem(target: str, page: Path) -> str | None:
    path, _, extras = target.partition("[")
    extras = {e.strip() for e in extras.rstrip("]").split(",") if e.strip()}
    if path.startswith(PLACEHOLDER):
        path = "." + path[len(PLACEHOLDER):]
    if path == "." or path.startswith(("./", "../")):
        if page.suffix == ".jinja":
            return None  # the generated project's own directory
        if not (ROOT / path).exists():
            return f"{target}: no such path in the checkout"
        if path == "." and not extras <= checkout_extras():
            return f"{target}: pyproject.toml declares no extra {sorted(extras - checkout_extras())}"
        return None
    if re.match(r"foretell\b", path, re.IGNORECASE):
        return f"{target}: not published; install it from the checkout by path"
    return None  # a published third-party package (torch, copier, ...)


def test_the_pages_hold_install_lines():
    found = {page.name for page in PAGES if install_targets(page.read_text(encoding="utf-8"))}
    assert {"README.md", "using.md", "authoring.md"} <= found


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("pip install foretell-ngram", "not published"),
        ("pip install 'foretell[fast]'", "not published"),
        ("pip install '.[nonesuch]'", "declares no extra"),
        ("pip install ./contrib/nonesuch", "no such path"),
    ],
)
def test_an_install_line_that_cannot_work_is_caught(line, says):
    (target,) = install_targets(line)
    assert says in (problem(target, ROOT / "README.md") or "")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_install_line_works_from_the_checkout(page):
    text = page.read_text(encoding="utf-8")
    problems = [p for t in install_targets(text) if (p := problem(t, page))]
    assert problems == []


CI = ROOT / ".ci" / "run"
#: Lines of .ci/run that set the shell up and install or run nothing.
SETUP = {"#!/usr/bin/env bash", "set -euo pipefail", 'cd "$(dirname "$0")/.."'}


def readme_commands() -> list[str]:
    """The README's fenced one-line commands that start from a fresh venv, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```\n(.*?)\n```$", text, re.MULTILINE | re.DOTALL)
    return [b for b in blocks if "\n" not in b and b.startswith("python3 -m venv ")]


def ci_commands(text: str) -> list[str]:
    """.ci/run's commands, past its shell setup and comments, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", "", text)
    lines = [line.strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#") and line not in SETUP]


def test_ci_runs_the_readmes_test_command_before_installing_anything_else():
    install, test = readme_commands()
    assert install.endswith("pip install . && foretell run")
    assert test.endswith("pytest -q")
    text = CI.read_text(encoding="utf-8")
    assert "set -euo pipefail" in text.splitlines()[:3]
    assert ci_commands(text)[0] == test


@pytest.mark.parametrize(
    ("script", "why"),
    [
        ("set -euo pipefail\npip install -q torch\n{test}\n", "installs torch first"),
        ("set -euo pipefail\n{test} -x\n", "a changed command"),
        ("set -euo pipefail\npython3 -m venv .venv && . .venv/bin/activate && \\\n"
         "    pip install -e '.[test,bench]' && python -m pytest -q\n", "another extra"),
    ],
)
def test_a_ci_script_that_drifts_from_the_readme_is_caught(script, why):
    test = readme_commands()[1]
    assert ci_commands(script.format(test=test))[0] != test, why
