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
