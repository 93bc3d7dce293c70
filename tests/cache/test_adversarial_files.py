"""Files an adversary (or an accident) puts where a layout expects its own, in both
built-in layouts: an entry or manifest truncated out to 10 GiB, a symbolic link to
``/dev/zero``, a FIFO, a directory, a FIFO named like a block. Each is refused without
being read whole (the process stays within a small memory budget: a fresh process under
an address-space limit, ``hostile_reader.py``), and none makes ``run`` or ``foretell
cache`` wait forever (a subprocess with a timeout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cachefill import filled_kv

from foretell.cache.codecs import snapshot_entry
from foretell.store.single_file import SingleFileLayout
from foretell_blockstore.layout import BlockStoreLayout

LAYOUTS = {"single-file": SingleFileLayout, "blocks": BlockStoreLayout}
READER = Path(__file__).with_name("hostile_reader.py")
#: A hang guard, not a measurement: a process that waits on a FIFO never ends.
HANG_S = 180


def stored(tmp_path, identity, codecs, layout_name):
    """A layout holding one entry, and its key."""
    layout = LAYOUTS[layout_name](tmp_path, None, identity=identity)
    entry = snapshot_entry(list(range(1, 9)), [filled_kv(8), filled_kv(8)], codecs)
    assert layout.write(entry)
    return layout, layout.key_for(entry.tokens)


def sparse_10_gib(path: Path) -> None:
    path.unlink()
    with open(path, "wb") as fh:
        fh.truncate(10 << 30)  # sparse: no disk, 10 GiB to whoever reads it whole


def dev_zero(path: Path) -> None:
    path.unlink()
    os.symlink("/dev/zero", path)


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


SABOTAGES = {"sparse-10GiB": sparse_10_gib, "dev-zero": dev_zero, "fifo": fifo,
             "directory": directory}


def read_in_a_fresh_process(layout, key) -> dict:
    identity = layout.identity
    fields = {"model_fingerprint": identity.model_fingerprint, "kv_scheme": identity.kv_scheme,
              "model_id": identity.model_id, "tokenizer_hash": identity.tokenizer_hash,
              "codec_providers": sorted(identity.codec_providers)}
    cls = type(layout)
    done = subprocess.run(
        [sys.executable, str(READER), f"{cls.__module__}:{cls.__name__}",
         str(layout.directory.parent if cls is SingleFileLayout else layout.directory.parent.parent),
         json.dumps(fields), key],
        capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("sabotage", sorted(SABOTAGES))
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_an_entry_file_that_is_not_an_entry_is_refused_without_reading_it_whole(
        tmp_path, identity, codecs, layout_name, sabotage):
    layout, key = stored(tmp_path, identity, codecs, layout_name)
    path = layout.path(key)
    SABOTAGES[sabotage](path)
    found = read_in_a_fresh_process(layout, key)
    assert not found["served"] and key not in found["scanned"]
    assert found["rss_growth_mb"] < 128, found
    if sabotage != "sparse-10GiB":  # not a regular file: never opened, kept, and said so
        assert os.path.lexists(path)
        assert found["skipped"][str(path)].startswith("not a regular file"), found


def test_a_fifo_named_like_a_block_fails_the_read_instead_of_hanging(tmp_path, identity, codecs):
    layout, key = stored(tmp_path, identity, codecs, "blocks")
    [block] = list(layout.data_dir.glob("*.blk"))[:1]
    fifo(block)
    found = read_in_a_fresh_process(layout, key)
    assert not found["served"]
    assert not layout.path(key).exists()  # dropped, as an entry missing a block is


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_cache_commands_pass_over_a_fifo_named_like_an_entry(tmp_path, identity, codecs,
                                                             layout_name):
    """`foretell cache ls` and `verify` find identities by reading every entry file's
    header: a FIFO among them is listed as skipped, not waited on."""
    layout, key = stored(tmp_path, identity, codecs, layout_name)
    other = layout.key_for(list(range(100, 108)))
    os.mkfifo(layout.path(other))
    for action in ("ls", "verify"):
        done = subprocess.run(
            [sys.executable, "-m", "foretell", "cache", action, "--cache-dir", str(tmp_path),
             "--json"], capture_output=True, text=True, timeout=HANG_S)
        assert done.returncode == 0, done.stderr[-2000:]
        report = json.loads(done.stdout)
        assert {s["path"]: s["reason"] for s in report["skipped"]}[
            str(layout.path(other))] == "not a regular file (a FIFO)"


def bait(layout, victim: Path) -> None:
    """Files in ``victim`` that a layout whose directory ``victim`` were would delete: a
    corrupt entry and an old interrupted write (and, for the block store, an unreferenced
    block and its folders' interrupted writes)."""
    folders = ([victim] if isinstance(layout, SingleFileLayout)
               else [victim / "blocks-v4" / "entries", victim / "blocks-v4" / "data"])
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "old.tmp").write_bytes(b"an interrupted write")
        os.utime(folder / "old.tmp", (0, 0))
    (folders[0] / f"{'0' * 32}.safetensors").write_bytes(b"not an entry at all")
    if not isinstance(layout, SingleFileLayout):
        (folders[1] / f"{'0' * 32}.blk").write_bytes(b"a block no manifest lists")


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_a_fingerprint_directory_linked_out_of_the_root_has_nothing_deleted_there(
        tmp_path, identity, codecs, layout_name, caplog, capsys):
    """`run` and `foretell cache` delete corrupt entries, interrupted writes and unused
    blocks in a model's directory; when that directory is a link out of the cache root,
    nothing there is touched (and nothing new written), with one warning naming it."""
    from foretell.cli import main

    root, victim = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    victim.mkdir()
    os.symlink(victim, root / identity.directory)
    layout = LAYOUTS[layout_name](root, None, identity=identity)
    bait(layout, victim)
    before = files_under(victim)
    entry = snapshot_entry(list(range(1, 9)), [filled_kv(8), filled_kv(8)], codecs)
    with caplog.at_level("WARNING", logger="foretell.store"):
        assert layout.scan() == [] and layout.collect() == 0
        assert layout.write(entry) is False
        assert layout.remove(layout.key_for(list(range(9)))) is False
    assert files_under(victim) == before
    warned = [r for r in caplog.records if "leads outside the cache root" in r.getMessage()]
    assert len(warned) == 1 and str(victim) in warned[0].getMessage()
    for action in ("verify", "gc", "clear"):
        main(["cache", action, "--cache-dir", str(root), "--json"])
        assert files_under(victim) == before, action
    capsys.readouterr()
