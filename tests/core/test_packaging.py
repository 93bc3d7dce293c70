"""The wheel carries core, the built-in plugins and their entry points."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILTINS = {"qwen": "foretell_qwen", "gemma": "foretell_gemma"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    (path,) = out.glob("foretell-*.whl")
    return zipfile.ZipFile(path)


@pytest.mark.slow
def test_wheel_contains_core_and_builtin_plugins(wheel):
    names = set(wheel.namelist())
    assert {"foretell/__init__.py", "foretell/plugin/hookspecs.py", "foretell/cli/__init__.py"} <= names
    for package in BUILTINS.values():
        assert f"{package}/__init__.py" in names


@pytest.mark.slow
def test_wheel_ships_the_demo_models(wheel):
    names = set(wheel.namelist())
    for model in ("demo", "demo-draft", "demo-gemma"):
        for file in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert f"foretell/demo/{model}/{file}" in names
    assert "foretell/demo/demo/mtp.safetensors" in names
    shipped = sum(i.file_size for i in wheel.infolist() if i.filename.endswith(".safetensors"))
    assert shipped <= 32 << 20


@pytest.mark.slow
def test_wheel_declares_builtins_and_the_pytest_plugin_as_entry_points(wheel):
    (ep_file,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(ep_file).decode()
    assert "[foretell.plugins]" in text and "[pytest11]" in text
    for name, package in BUILTINS.items():
        assert f"{name} = {package}" in text
    assert "foretell = foretell.cli:main" in text


def test_every_builtin_in_pyproject_registers_a_contribution():
    from foretell.plugin import load_plugins

    records = {r.name: r for r in load_plugins().records}
    for name in BUILTINS:
        assert records[name].status == "loaded", records[name].error
        assert records[name].kind == "built-in" and records[name].contributions
