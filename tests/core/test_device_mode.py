"""The CUDA-default switches (matmul attention, fixed-shape verify forwards) read their
environment variable one way: unset or ``auto`` lets the device decide, a listed value
forces it, anything else is an error naming the variable."""

from __future__ import annotations

import pytest

from foretell.errors import ConfigError
from foretell.platform.device import device_mode


def _mode():
    return device_mode("FORETELL_TEST_MODE", cuda="on", elsewhere="off", choices=("on", "off"))


def test_unset_or_auto_lets_the_device_decide(monkeypatch):
    monkeypatch.delenv("FORETELL_TEST_MODE", raising=False)
    assert _mode() == "off"  # the suite runs on the CPU
    monkeypatch.setenv("FORETELL_TEST_MODE", "auto")
    assert _mode() == "off"


def test_a_listed_value_forces_it(monkeypatch):
    monkeypatch.setenv("FORETELL_TEST_MODE", "on")
    assert _mode() == "on"


def test_anything_else_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FORETELL_TEST_MODE", "yes")
    with pytest.raises(ConfigError, match="FORETELL_TEST_MODE"):
        _mode()


def test_a_person_is_told_when_the_cuda_kernel_cache_is_empty(monkeypatch, tmp_path):
    """A fresh CUDA host's first run waits ~40 s while the driver compiles MLX's kernels
    (measured on the H200): said once, before the wait, only where it can happen."""
    from foretell.platform import device

    monkeypatch.delenv("CUDA_CACHE_DISABLE", raising=False)
    monkeypatch.setenv("CUDA_CACHE_PATH", str(tmp_path / "ComputeCache"))
    assert device.cold_cuda_note() is None  # the CPU: nothing to compile
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    assert "is empty" in device.cold_cuda_note()
    assert str(tmp_path / "ComputeCache") in device.cold_cuda_note()
    (tmp_path / "ComputeCache").mkdir()
    assert "is empty" in device.cold_cuda_note()
    (tmp_path / "ComputeCache" / "index").write_bytes(b"x")
    assert device.cold_cuda_note() is None  # compiled before: no wait
    monkeypatch.setenv("CUDA_CACHE_DISABLE", "1")
    assert "every run" in device.cold_cuda_note()


def test_foretell_run_prints_the_note_before_loading_and_not_with_json(monkeypatch, capsys):
    from foretell.cli import run_cmd
    from foretell.platform import device

    monkeypatch.setattr(device, "cold_cuda_note", lambda: "foretell: NOTE")
    loaded = []

    def load(path, **_kw):
        loaded.append(capsys.readouterr().err)
        raise SystemExit(0)

    monkeypatch.setattr("foretell.generate.load", load)
    for quiet in (False, True):
        with pytest.raises(SystemExit):
            run_cmd.open_engine("demo", registry=None, quiet=quiet)
    assert loaded == ["foretell: NOTE\n", ""]
