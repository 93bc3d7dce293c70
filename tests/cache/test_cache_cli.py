"""``foretell run --cache-dir`` end to end, ``--resume`` after ``kill -9``, a full disk
mid-run, and ``foretell cache ls|stats|verify|gc|clear``."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from foretell.cli import main
from foretell.tools import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("cli") / "qwen3", "qwen3")


def run_json(capsys, *argv) -> dict:
    assert main(["run", "--json", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])


def cache_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["cache", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_a_second_run_reuses_the_first_runs_prompt_from_disk(model_dir, tmp_path, capsys):
    args = ["--model", str(model_dir), "--prompt", "The quick brown fox", "--max-tokens", "5",
            "--cache-dir", str(tmp_path)]
    first = run_json(capsys, *args)
    second = run_json(capsys, *args)
    assert (first["cached_tokens"], first["cached_from"]) == (0, None)
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    assert second["cached_from"] == "ssd"


def test_cache_commands_list_verify_and_clean(model_dir, tmp_path, capsys):
    # The single-file layout's files (test_cache_cli_blocks.py does the same for blocks).
    run_json(capsys, "--model", str(model_dir), "--prompt", "def fibonacci(n):",
             "--max-tokens", "4", "--cache-dir", str(tmp_path), "--cache-layout", "single-file")
    code, listing = cache_json(capsys, "ls", "--cache-dir", str(tmp_path))
    assert code == 0 and len(listing["entries"]) == 1
    entry = listing["entries"][0]
    assert entry["layout"] == "single-file"  # the name --layout and [cache] layout take
    code, stats = cache_json(capsys, "stats", "--cache-dir", str(tmp_path))
    assert stats["entries"] == 1 and stats["models"][0]["layout"] == "single-file" and stats["bytes"] == entry["bytes"]
    assert cache_json(capsys, "verify", "--cache-dir", str(tmp_path)) == (
        0, {"verified": 1, "bad": [], "skipped": []})

    path = next(tmp_path.glob("*/*.safetensors"))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    (path.parent / "deadbeef.1234.tmp").write_bytes(b"partial")
    code, report = cache_json(capsys, "verify", "--cache-dir", str(tmp_path))
    assert code == 1 and report["verified"] == 0 and len(report["bad"]) == 1
    assert not path.exists()

    code, _ = cache_json(capsys, "gc", "--cache-dir", str(tmp_path))
    assert code == 0
    run_json(capsys, "--model", str(model_dir), "--prompt", "def fibonacci(n):",
             "--max-tokens", "4", "--cache-dir", str(tmp_path), "--cache-layout", "single-file")
    code, cleared = cache_json(capsys, "clear", "--cache-dir", str(tmp_path))
    assert code == 0 and (cleared["removed"], cleared["not_removed"]) == (1, 0)
    assert cleared["freed_bytes"] > 0 and cleared["skipped"] == []
    assert cache_json(capsys, "ls", "--cache-dir", str(tmp_path)) == (
        0, {"entries": [], "skipped": []})


def test_the_listing_names_its_columns_and_aligns_them(model_dir, tmp_path, capsys):
    for prompt, layout in (("def fibonacci(n):", "single-file"), ("import os", "blocks")):
        run_json(capsys, "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "4",
                 "--cache-dir", str(tmp_path), "--cache-layout", layout)
    assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["KEY", "TOKENS", "SIZE", "LAST", "USED", "MODEL", "LAYOUT",
                              "NAMESPACE"]
    assert len(lines) == 2 and {line.split()[-2] for line in lines} == {"single-file",
                                                                         "blocks"}
    for column in ("LAYOUT", "NAMESPACE"):  # each row's cell starts under its name
        at = header.index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in lines), column


def test_verify_reports_a_stray_file_as_skipped_and_passes(model_dir, tmp_path, capsys):
    """A file foretell did not write, in a folder of the cache directory that no model's
    entries use: not ours to judge or delete, so reported as kept; verify passes."""
    run_json(capsys, "--model", str(model_dir), "--prompt", "def f(n):", "--max-tokens", "2",
             "--cache-dir", str(tmp_path), "--cache-layout", "single-file")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "weights.safetensors").write_bytes(b"not an entry")
    code, report = cache_json(capsys, "verify", "--cache-dir", str(tmp_path))
    assert code == 0 and report["bad"] == [] and report["verified"] == 1
    assert [s["reason"] for s in report["skipped"]] == ["not a foretell entry"]


def test_kv_bits_or_layout_without_a_model_is_an_error_not_ignored(tmp_path, capsys):
    for flag in (["--kv-bits", "4"], ["--layout", "blocks"]):
        assert main(["cache", "ls", "--cache-dir", str(tmp_path), *flag]) == 1
        assert "--model" in capsys.readouterr().err


def test_a_cache_directory_that_does_not_exist_is_one_error(tmp_path, capsys):
    assert main(["cache", "ls", "--cache-dir", str(tmp_path / "nope")]) == 1
    assert "--cache-dir" in capsys.readouterr().err


def test_a_cache_directory_that_is_a_file_is_refused_naming_the_field(model_dir, tmp_path,
                                                                      capsys):
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    code = main(["run", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2",
                 "--cache-dir", str(afile)])
    err = capsys.readouterr().err
    assert code == 1 and "cache.dir" in err and "is a file, not a directory" in err
    assert "--cache-dir" in err
    assert afile.read_text() == "mine"  # nothing written into it


def test_a_full_disk_mid_run_completes_the_run_with_one_warning(model_dir, tmp_path, capsys,
                                                                  monkeypatch, caplog):
    def full(*_args, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING):
        code = main(["run", "--model", str(model_dir), "--prompt", "hello there",
                     "--max-tokens", "5", "--cache-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 0 and "Generation: 5 tokens" in captured.err
    assert sum("disk full or unwritable" in r.message for r in caplog.records) == 1
    assert "the cache is not durable" in captured.err


def foretell_cmd(*argv) -> list[str]:
    return [sys.executable, "-m", "foretell", *argv]


def test_resume_after_kill_9_continues_identically(tmp_path, killed_and_resumed):
    config = tmp_path / "run.toml"
    config.write_text("[cache]\ncheckpoint_every = 4\n")
    args = ["run", "--max-tokens", "120", "--prompt", "def fibonacci(n):", "--config", str(config)]
    env = {**os.environ, "FORETELL_DEBUG": "1"}
    uninterrupted, resumed = killed_and_resumed(foretell_cmd(*args), env)
    assert b"(checkpoint)" in resumed.stderr
    assert resumed.stdout == uninterrupted.stdout


class RecordingTier:
    ssd = object()

    def __init__(self):
        self.closed_with = None

    def close(self, timeout):
        from foretell.cache.spill import FlushReport

        self.closed_with = timeout
        return FlushReport(durable=False, pending=1, dropped=0, failed=0, missing=0)


def test_sigterm_flushes_the_cache_with_a_bounded_wait_and_says_it_is_not_durable(capsys):
    from foretell.cli.cache_cmd import Terminated, flushing

    tier = RecordingTier()
    with pytest.raises(Terminated), flushing(tier, timeout=1.5):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal interrupts this
    assert tier.closed_with == 1.5
    assert "not durable (pending 1" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_ends_a_chat_session_with_its_cache_flushed(model_dir, tmp_path):
    """SIGTERM ends ``foretell chat`` (not only its turn, as Ctrl-C does) after the bounded
    flush, with the exit status of a process the signal ended (143)."""
    import subprocess
    import sys

    chat = subprocess.Popen(
        [sys.executable, "-m", "foretell", "chat", "--model", str(model_dir), "--max-tokens",
         "4", "--cache-dir", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    chat.stdin.write("hello there\n")
    chat.stdin.flush()
    seen = ""
    while "prompt tokens cached" not in seen:  # the turn is over: chat waits for the next
        line = chat.stderr.readline()
        assert line, f"chat ended early: {seen}"
        seen += line
    chat.send_signal(signal.SIGTERM)
    assert chat.wait(timeout=30) == 143
    assert list(tmp_path.glob("*/blocks-v4/entries/*.safetensors"))  # the turn was stored


def chat_notes(model_dir, monkeypatch, capsys, *extra) -> list[int]:
    """Prompt tokens cached per turn, from ``foretell chat``'s notes on stderr."""
    import io
    import re

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hello there\nand again\n")))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "4", *extra]) == 0
    return [int(n) for n in re.findall(r"(\d+) prompt tokens cached", capsys.readouterr().err)]


@pytest.mark.parametrize("command, flags, named", [
    ("run", ["--resume"], "cache.resume: needs a cache directory"),
    ("run", ["--cache-max-gb", "2"], "cache.max_gb: needs a cache directory (--cache-dir DIR), "
                                     "set by --cache-max-gb"),
    ("chat", ["--cache-layout", "single-file"], "set by --cache-layout"),
])
def test_settings_of_the_disk_tier_without_a_directory_are_refused(
        model_dir, capsys, command, flags, named):
    """Given where there is no SSD tier they would be ignored in silence; nothing runs."""
    assert main([command, "--model", str(model_dir), "--max-tokens", "2", *flags]) != 0
    err = capsys.readouterr().err
    assert named in err and "Prompt:" not in err


def test_a_config_files_disk_settings_wait_for_a_directory(model_dir, tmp_path, capsys):
    """A config may hold the tier's defaults for runs that name the directory on the
    command line: alone, they run without one."""
    config = tmp_path / "run.toml"
    config.write_text('[cache]\nmax_gb = 2\nlayout = "single-file"\n')
    stats = run_json(capsys, "--model", str(model_dir), "--max-tokens", "2", "--config",
                     str(config))
    assert stats["cached_tokens"] == 0
    stats = run_json(capsys, "--model", str(model_dir), "--max-tokens", "2", "--config",
                     str(config), "--cache-dir", str(tmp_path))
    assert list(tmp_path.glob("*/*.safetensors"))  # the config's layout, the flag's directory


def test_chat_offers_no_resume_and_says_a_configs_resume_is_not_for_it(
        model_dir, tmp_path, monkeypatch, capsys):
    """`--resume` reruns an identical `foretell run`; a chat has no such command to rerun,
    so it is not offered, and a shared config's `resume = true` is named as ignored."""
    import io

    with pytest.raises(SystemExit):
        main(["chat", "--model", str(model_dir), "--resume"])
    assert "unrecognized arguments: --resume" in capsys.readouterr().err
    config = tmp_path / "run.toml"
    config.write_text(f'[cache]\ndir = "{tmp_path}"\nresume = true\n')
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))
    assert main(["chat", "--model", str(model_dir), "--max-tokens", "2", "--config",
                 str(config)]) == 0
    assert "[cache] resume applies to `foretell run` only" in capsys.readouterr().err


def test_chat_turns_reuse_the_previous_turn_and_a_restart_reuses_the_disk(
        model_dir, tmp_path, monkeypatch, capsys):
    first, second = chat_notes(model_dir, monkeypatch, capsys, "--cache-dir", str(tmp_path))
    assert first == 0 and second > 0
    restarted = chat_notes(model_dir, monkeypatch, capsys, "--cache-dir", str(tmp_path))
    assert restarted[0] > 0 and restarted[1] >= second
