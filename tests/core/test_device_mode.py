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
    from foretell.platform import device

    monkeypatch.setattr(device, "on_cuda", lambda: False)
    monkeypatch.delenv("FORETELL_TEST_MODE", raising=False)
    assert _mode() == "off"
    monkeypatch.setenv("FORETELL_TEST_MODE", "auto")
    assert _mode() == "off"
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    assert _mode() == "on"


def test_a_listed_value_forces_it(monkeypatch):
    monkeypatch.setenv("FORETELL_TEST_MODE", "on")
    assert _mode() == "on"


def test_anything_else_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("FORETELL_TEST_MODE", "yes")
    with pytest.raises(ConfigError, match="FORETELL_TEST_MODE"):
        _mode()


def test_a_person_is_told_when_mlx_has_compiled_no_kernels_here(monkeypatch, tmp_path):
    """A CUDA host's first run waits while MLX compiles its kernels: said once, before the
    wait, only where it can happen."""
    from foretell.platform import device

    kept = tmp_path / "kernels"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(kept))
    monkeypatch.setattr(device, "on_cuda", lambda: False)
    assert device.cold_cuda_note() is None  # the CPU: nothing to compile
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    assert str(kept) in device.cold_cuda_note()
    kept.mkdir()
    (kept / "foretell-qmm-b4-g64-affine-bfloat16-64x64-r16.done").touch()
    assert "compiled no kernels" in device.cold_cuda_note()  # a marker is not a kernel
    (kept / "gather_bfloat16_int32_1.ptx").write_bytes(b"ptx")
    assert device.cold_cuda_note() is None  # compiled before: no wait


def test_foretell_run_prints_the_note_before_loading_and_not_with_json(monkeypatch, capsys):
    from foretell.cli import run_cmd
    from foretell.platform import device

    monkeypatch.setattr(device, "cold_cuda_note", lambda: "foretell: NOTE")
    loaded = []

    def load(path, **_kw):
        loaded.append(capsys.readouterr().err)
        raise SystemExit(0)

    monkeypatch.setattr("foretell.engine.load", load)
    for quiet in (False, True):
        with pytest.raises(SystemExit):
            run_cmd.open_engine("demo", registry=None, quiet=quiet)
    assert loaded == ["foretell: NOTE\n", ""]
