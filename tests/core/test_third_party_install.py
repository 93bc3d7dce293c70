"""A real third-party distribution, installed with pip, is discovered; uninstalled, it is gone."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONTRIB = Path(__file__).resolve().parents[2] / "contrib" / "foretell-ngram"


def _pip(*args):
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)


def _contributions():
    out = subprocess.run(
        [sys.executable, "-m", "foretell", "plugins", "--json"],
        check=True, capture_output=True, text=True, timeout=120,
    ).stdout
    rows = json.loads(out)["plugins"]
    return {(r["name"], r["kind"], r["status"]): [f"{c['kind']}:{c['name']}" for c in r["contributes"]] for r in rows}


def _selected_kind():
    script = (
        "from foretell.plugin import load_plugins;"
        "from foretell.config import load_run_config;"
        "cfg = load_run_config(load_plugins().registry, overrides={'draft': ({'kind': 'ngram', 'max_ngram': 4}, '--draft')});"
        "from foretell.spec import Feed;"
        "src = cfg.draft and __import__('foretell_ngram.lookup').lookup.NgramProvider(cfg.draft.options).open();"
        "src.prefill(Feed([1, 2, 3, 1, 2]));"
        "print(cfg.draft.options.max_ngram, src.draft(Feed([]), 2).tokens[0].tolist())"
    )
    return subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120).stdout.strip()


@pytest.mark.slow
def test_pip_installed_plugin_is_discovered_usable_and_removed_on_uninstall(tmp_path):
    # Build from a copy: setuptools leaves an .egg-info beside the sources, which would make
    # the source tree itself look like an installed distribution.
    source = shutil.copytree(CONTRIB, tmp_path / "foretell-ngram")
    was_installed = any(name == "ngram" for name, _, _ in _contributions())
    _pip("uninstall", "-y", "foretell-ngram")
    assert not any(name == "ngram" for name, _, _ in _contributions())
    try:
        _pip("install", "--no-deps", "--no-build-isolation", str(source))
        assert _contributions()[("ngram", "third-party", "loaded")] == ["draft:ngram"]
        assert _selected_kind() == "4 [3, 1]"
    finally:
        _pip("uninstall", "-y", "foretell-ngram")
        gone = not any(name == "ngram" for name, _, _ in _contributions())
        if was_installed:  # leave the environment as the test found it (CI installs it)
            _pip("install", "--no-deps", "--no-build-isolation", "-e", str(CONTRIB))
    assert gone
