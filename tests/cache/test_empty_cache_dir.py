"""An empty cache directory (``--cache-dir ""``, most likely an unset shell variable) is an
error naming the flag, never a cache in the current directory."""

from __future__ import annotations

import os

import pytest

import foretell
from foretell.cli import main
from foretell.errors import ConfigError
from foretell.tools import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("empty-dir") / "qwen3", "qwen3")


@pytest.mark.parametrize("argv", [["run", "--prompt", "hello", "--max-tokens", "2"],
                                  ["cache", "ls"], ["cache", "clear"]])
def test_an_empty_cache_dir_flag_is_an_error_naming_it(model_dir, tmp_path, monkeypatch,
                                                       capsys, argv):
    monkeypatch.chdir(tmp_path)
    if argv[0] == "run":
        argv = [*argv, "--model", str(model_dir)]
    assert main([*argv, "--cache-dir", ""]) != 0
    err = capsys.readouterr().err
    assert "--cache-dir" in err and "empty" in err
    assert os.listdir(tmp_path) == []  # nothing cached (or deleted) in the current directory


def test_an_engine_refuses_an_empty_cache_dir(model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="cache_dir: is empty"):
        foretell.load(model_dir, cache="")
    assert os.listdir(tmp_path) == []
