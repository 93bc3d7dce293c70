"""templates/plugin renders into a plugin whose own test passes, for every contribution kind.

Rendered with jinja2 the way copier does (``.jinja`` files and templated paths), so the
test needs no copier install.
"""

import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "plugin"


def render(target: Path, answers: dict) -> Path:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    for source in TEMPLATE.rglob("*"):
        if source.is_dir() or source.name == "copier.yml":
            continue
        rel = env.from_string(str(source.relative_to(TEMPLATE))).render(answers)
        out = target / rel.removesuffix(".jinja")
        out.parent.mkdir(parents=True, exist_ok=True)
        text = source.read_text(encoding="utf-8")
        out.write_text(env.from_string(text).render(answers) if source.suffix == ".jinja" else text)
    return target


@pytest.mark.parametrize("contributes", ["draft", "codec", "layout", "architecture"])
def test_generated_plugin_registers_and_its_tests_pass(tmp_path, contributes):
    answers = {
        "plugin_name": "my-thing",
        "module_name": "foretell_my_thing",
        "description": "A test plugin",
        "contributes": contributes,
    }
    project = render(tmp_path / "foretell-my-thing", answers)
    assert 'my-thing = "foretell_my_thing"' in (project / "pyproject.toml").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project, capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(project / "src")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
