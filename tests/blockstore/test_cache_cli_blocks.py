"""``foretell run --cache-layout blocks`` reuses prompts from block-store entries, and
``foretell cache stats|verify|gc`` act on them: logical vs on-disk bytes, damaged blocks
reported, unreferenced blocks freed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foretell.cli import main
from foretell.tools import make_model_dir

# Long enough (well over 2 blocks of 256 tokens) that its continuation shares whole blocks.
PROMPT = "".join(f"def f{i}(n):\n    return n * {i} + f{i - 1}(n - 1)\n" for i in range(60))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("cli") / "qwen3", "qwen3")


def run_json(capsys, *argv) -> dict:
    assert main(["run", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def cache_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["cache", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_runs_share_blocks_and_cache_commands_see_them(model_dir, tmp_path, capsys):
    base = ["--model", str(model_dir), "--max-tokens", "3", "--cache-dir", str(tmp_path),
            "--cache-layout", "blocks"]
    first = run_json(capsys, *base, "--prompt", PROMPT)
    again = run_json(capsys, *base, "--prompt", PROMPT)
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] == again["prompt_tokens"] - 1 and again["cached_from"] == "ssd"
    other = run_json(capsys, *base, "--prompt", PROMPT + "def g(n):\n    return 0\n")
    assert other["prompt_tokens"] > 600 and other["cached_tokens"] > 512
    assert list(tmp_path.glob("*/blocks-v4/entries/*.safetensors"))
    assert not list(tmp_path.glob("*/*.safetensors"))  # nothing in the single-file layout

    code, stats = cache_json(capsys, "stats", "--cache-dir", str(tmp_path))
    [group] = stats["models"]
    assert code == 0 and group["layout"] == "blocks" and group["entries"] >= 2
    assert group["disk_bytes"] < group["bytes"] and group["dedup_ratio"] > 1
    assert cache_json(capsys, "verify", "--cache-dir", str(tmp_path)) == (
        0, {"verified": group["entries"], "bad": [], "skipped": []})

    block = max(tmp_path.glob("*/blocks-v4/data/*.blk"), key=lambda p: p.stat().st_size)
    raw = bytearray(block.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    block.write_bytes(bytes(raw))
    code, report = cache_json(capsys, "verify", "--cache-dir", str(tmp_path))
    assert code == 1 and report["bad"] and report["verified"] < group["entries"]

    code, gc = cache_json(capsys, "gc", "--cache-dir", str(tmp_path))
    assert code == 0 and gc["freed_bytes"] > 0  # the dropped entries' other blocks
    code, after = cache_json(capsys, "verify", "--cache-dir", str(tmp_path))
    assert code == 0 and after["bad"] == []


def test_clear_leaves_no_block_behind_and_says_what_it_freed(model_dir, tmp_path, capsys):
    run_json(capsys, "--model", str(model_dir), "--max-tokens", "3", "--cache-dir",
             str(tmp_path), "--prompt", PROMPT)
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("*/blocks-v4/*/*") if p.is_file())
    code, cleared = cache_json(capsys, "clear", "--cache-dir", str(tmp_path))
    assert code == 0 and cleared["removed"] >= 1 and cleared["freed_bytes"] == on_disk
    assert not list(tmp_path.glob("*/blocks-v4/data/*.blk"))


def test_gc_and_clear_count_only_what_left_the_disk(model_dir, tmp_path, capsys,
                                                    monkeypatch):
    """A read-only directory (every unlink refused): nothing is reported evicted, removed
    or freed, and clear fails."""
    import errno
    import os

    run_json(capsys, "--model", str(model_dir), "--max-tokens", "3", "--cache-dir",
             str(tmp_path), "--prompt", PROMPT)

    def refused(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "unlink", refused)
    code, gc = cache_json(capsys, "gc", "--cache-dir", str(tmp_path), "--max-gb", "0")
    assert code == 0 and (gc["evicted"], gc["freed_bytes"]) == (0, 0)
    code, cleared = cache_json(capsys, "clear", "--cache-dir", str(tmp_path))
    assert code == 1 and cleared["removed"] == 0 and cleared["not_removed"] >= 1
    assert cleared["freed_bytes"] == 0


def test_looking_at_a_models_entries_changes_nothing_in_an_empty_directory(model_dir,
                                                                            tmp_path, capsys):
    for action in ("ls", "stats", "verify", "gc"):
        assert main(["cache", action, "--cache-dir", str(tmp_path), "--model",
                     str(model_dir), "--kv-bits", "4"]) == 0
    capsys.readouterr()
    assert list(tmp_path.iterdir()) == []


def test_verify_says_why_and_does_not_reorder_what_eviction_takes_first(model_dir, tmp_path,
                                                                         capsys):
    """verify reads every entry without marking it used (a later gc still evicts the
    least recently used), and names each bad entry's fault."""
    import os

    base = ["--model", str(model_dir), "--max-tokens", "3", "--cache-dir", str(tmp_path)]
    for i, prompt in enumerate(("def a():\n", "class B:\n", "import os\n")):
        run_json(capsys, *base, "--prompt", prompt * 40)
        for manifest in tmp_path.glob("*/blocks-v4/entries/*.safetensors"):
            if manifest.stat().st_mtime > 2e9:
                continue
            os.utime(manifest, (1e9 + i, 1e9 + i))  # oldest first, a second apart
    order = sorted(tmp_path.glob("*/blocks-v4/entries/*.safetensors"),
                   key=lambda p: p.stat().st_mtime)
    times = [p.stat().st_mtime for p in order]
    block = max(tmp_path.glob("*/blocks-v4/data/*.blk"), key=lambda p: p.stat().st_size)
    raw = bytearray(block.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    block.write_bytes(bytes(raw))
    code, report = cache_json(capsys, "verify", "--cache-dir", str(tmp_path))
    assert code == 1 and all("checksum" in bad["reason"] for bad in report["bad"])
    assert [p.stat().st_mtime for p in order if p.exists()] == [
        t for p, t in zip(order, times) if p.exists()]


def test_toml_cache_layout_selects_the_block_store(model_dir, tmp_path, capsys):
    config = tmp_path / "run.toml"
    cache = tmp_path / "cache"
    config.write_text(f'[cache]\ndir = "{cache}"\nlayout = "blocks"\n')
    run_json(capsys, "--config", str(config), "--model", str(model_dir), "--max-tokens", "2",
             "--prompt", "def f(x):")
    assert list(cache.glob("*/blocks-v4/entries/*.safetensors"))
    assert not list(cache.glob("*/*.safetensors"))


def test_the_block_store_is_the_default_layout(model_dir, tmp_path, capsys):
    from foretell.config import DEFAULT_LAYOUT, CacheSection
    from foretell_blockstore.layout import BlockStoreConfig

    assert CacheSection().layout == "blocks" == DEFAULT_LAYOUT
    assert BlockStoreConfig().block_tokens == 512  # chosen by measurement: docs/block-store.md
    run_json(capsys, "--model", str(model_dir), "--max-tokens", "2", "--prompt", "def f(x):",
             "--cache-dir", str(tmp_path))
    assert list(tmp_path.glob("*/blocks-v4/entries/*.safetensors"))
    assert not list(tmp_path.glob("*/*.safetensors"))
    code, listing = cache_json(capsys, "ls", "--cache-dir", str(tmp_path), "--model",
                               str(model_dir))  # --model without --layout: the default's
    assert code == 0 and [e["layout"] for e in listing["entries"]] == ["blocks"]


def test_an_engines_tier_uses_the_default_layout_unless_told(model_dir, tmp_path):
    import foretell
    from foretell.cache.tier import CacheTier
    from foretell.store.single_file import SingleFileLayout
    from foretell_blockstore.layout import BlockStoreLayout

    engine = foretell.load(str(model_dir))
    tier = CacheTier.for_engine(engine, tmp_path / "default")
    assert type(tier.ssd.layout) is BlockStoreLayout
    assert tier.ssd.layout.config.block_tokens == 512
    tier.close(5)
    told = CacheTier.for_engine(engine, tmp_path / "told", layout=SingleFileLayout)
    assert type(told.ssd.layout) is SingleFileLayout
    told.close(5)


def test_gc_older_than_deletes_entries_unused_since_of_every_model(model_dir, tmp_path,
                                                                   capsys):
    """Entries last used more than --older-than days ago go, whichever model (or KV scheme)
    they belong to (such as those no run will use again: weights since changed), with the
    blocks only they listed; the rest stay and still verify."""
    import os
    import time

    other = make_model_dir(tmp_path / "models" / "other", "qwen3",
                           overrides={"tie_word_embeddings": False})
    cache = tmp_path / "cache"
    base = ["--max-tokens", "3", "--cache-dir", str(cache)]
    run_json(capsys, *base, "--model", str(other), "--prompt", "import numpy as np")
    aged_dirs = {p.name for p in cache.iterdir()}
    old = time.time() - 10 * 86400
    for manifest in cache.glob("*/blocks-v4/entries/*"):
        os.utime(manifest, (old, old))
    run_json(capsys, *base, "--model", str(model_dir), "--prompt", "class Tree:")
    _, listed = cache_json(capsys, "ls", "--cache-dir", str(cache))
    aged = [e for e in listed["entries"] if e["directory"] in aged_dirs]
    kept = [e for e in listed["entries"] if e["directory"] not in aged_dirs]
    assert aged and kept
    assert cache_json(capsys, "gc", "--cache-dir", str(cache), "--older-than", "11") == (
        0, {"freed_bytes": 0, "evicted": 0})

    code, gc = cache_json(capsys, "gc", "--cache-dir", str(cache), "--older-than", "9")
    assert code == 0 and gc["evicted"] == len(aged) and gc["freed_bytes"] > 0
    _, listed = cache_json(capsys, "ls", "--cache-dir", str(cache))
    assert sorted(e["key"] for e in listed["entries"]) == sorted(e["key"] for e in kept)
    for directory in aged_dirs:
        assert not list((cache / directory).glob("blocks-v4/data/*.blk"))
    code, verified = cache_json(capsys, "verify", "--cache-dir", str(cache))
    assert code == 0 and verified["verified"] == len(kept)
