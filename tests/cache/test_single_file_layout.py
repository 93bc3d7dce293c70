"""The single-file layout serves only what it can verify, writes atomically, survives a
full or unwritable disk, and counts its bytes (the cap is the tier's: test_tier.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import time
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest
from cachefill import filled_kv, filled_rotating

from foretell.cache.codecs import snapshot_entry
from foretell.config import FieldError
from foretell.errors import ForetellError
from foretell.store.layout import (
    CorruptEntry,
    ForeignEntry,
    StorageLayout,
    StoreError,
    UnknownVersion,
)
from foretell.store.single_file import SingleFileConfig, SingleFileLayout


def make_entry(codecs, n=24, namespace="", dtype=mx.float32, seed_offset=0):
    caches = [filled_kv(n + seed_offset, dtype=dtype), filled_rotating(n, max_size=16, dtype=dtype)]
    if seed_offset:
        caches[0].trim(seed_offset)
    return snapshot_entry(range(n), caches, codecs, namespace=namespace)


def host(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32))


def files(layout) -> list[str]:
    return sorted(os.listdir(layout.directory)) if layout.directory.exists() else []


@pytest.fixture
def layout(tmp_path, identity):
    return SingleFileLayout(tmp_path, identity=identity)


@pytest.fixture
def stored(layout, codecs):
    entry = make_entry(codecs)
    assert layout.write(entry) is True
    return entry, layout.key_for(entry.tokens)


def header_span(path) -> tuple[int, int]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return 8, 8 + length


def rewrite(path, old: bytes, new: bytes) -> None:
    raw = path.read_bytes()
    assert raw.count(old) >= 1 and len(old) == len(new)
    path.write_bytes(raw.replace(old, new, 1))


# -- round trip ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_written_entry_reads_back_identical(layout, codecs, dtype):
    entry = make_entry(codecs, namespace="lora:abc", dtype=dtype)
    assert layout.write(entry) is True
    got = layout.read(layout.key_for(entry.tokens, "lora:abc"))
    assert got.tokens == entry.tokens and got.namespace == "lora:abc"
    for want, have in zip(entry.layers, got.layers):
        assert (have.codec, have.provider, dict(have.meta)) == (want.codec, want.provider, dict(want.meta))
        for name, array in want.tensors.items():
            assert have.tensors[name].dtype == dtype
            assert np.array_equal(host(have.tensors[name]), host(array))


def test_entry_is_a_safetensors_file_other_tools_open(layout, stored):
    from safetensors import safe_open

    entry, key = stored
    path = layout.path(key)
    with safe_open(str(path), framework="numpy") as f:
        header = json.loads(f.metadata()["foretell.header"])
        keys = f.get_tensor("layers.0.keys")
    assert header["tokens"] == list(entry.tokens) and header["num_tokens"] == len(entry.tokens)
    assert header["layers"][0]["provider"] == "foretell.baseline/kv@1"
    assert np.array_equal(keys, host(entry.layers[0].tensors["keys"]))
    arrays = mx.load(str(path))  # MLX's own loader reads it too
    assert np.array_equal(host(arrays["layers.1.values"]), host(entry.layers[1].tensors["values"]))


def test_header_records_identity_and_checksums(layout, stored, identity):
    from safetensors import safe_open

    _, key = stored
    with safe_open(str(layout.path(key)), framework="numpy") as f:
        meta = f.metadata()
    header = json.loads(meta["foretell.header"])
    assert meta["foretell.format_version"] == "2" and len(meta["foretell.header_hash"]) == 32
    for field in ("model_id", "model_fingerprint", "kv_scheme", "tokenizer_hash"):
        assert header[field] == getattr(identity, field)
    slots = [s for layer in header["layers"] for s in layer["tensors"].values()]
    assert header["checksum"] == "xxh3-64"
    assert all(len(s["xxh3"]) == 16 and s["xxh3"] != "0" * 16 for s in slots)
    assert header["data_bytes"] == sum(s["offsets"][1] - s["offsets"][0] for s in slots)


def test_rewriting_the_same_prompt_state_replaces_its_file(layout, codecs):
    layout.write(make_entry(codecs))
    layout.write(make_entry(codecs, seed_offset=3))  # same tokens, different values
    assert len([f for f in files(layout) if f.endswith(".safetensors")]) == 1
    assert len(layout.scan()) == 1


def test_a_removed_entry_is_gone(layout, stored):
    _, key = stored
    assert layout.remove(key) is True
    assert layout.read(key) is None and layout.scan() == [] and layout.bytes() == 0
    assert layout.remove(key) is False


# -- corruption: never serve a wrong byte ---------------------------------------------------


def test_a_flipped_tensor_byte_is_never_served_and_the_file_is_deleted(layout, stored, caplog):
    _, key = stored
    path = layout.path(key)
    raw = bytearray(path.read_bytes())
    raw[header_span(path)[1] + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.read(key) is None
    assert "fails its checksum" in caplog.text
    assert not path.exists()
    assert layout.read(key) is None and layout.scan() == []


def test_the_benchmarks_unverified_read_skips_only_checksums_and_serving_still_refuses(
        layout, stored):
    """``read_layers(verify=False)`` (the cache bench's row) returns a flipped byte where
    ``read_layers()`` and ``read()`` refuse it; it deletes nothing, ``read()`` does."""
    from foretell.store import format as fmt

    _, key = stored
    path = layout.path(key)
    raw = bytearray(path.read_bytes())
    raw[header_span(path)[1] + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    assert len(layout.read_layers(key, verify=False)) == 2
    with pytest.raises(fmt.CorruptEntry):
        layout.read_layers(key)
    assert path.exists() and layout.files(key) == [path]
    assert layout.read(key) is None and not path.exists()


def test_a_single_flipped_bit_anywhere_in_any_tensor_is_caught(tmp_path, identity, codecs):
    import random

    rng = random.Random(0)
    entry = make_entry(codecs)
    probe = SingleFileLayout(tmp_path / "probe", identity=identity)
    probe.write(entry)
    path = probe.path(probe.key_for(entry.tokens))
    raw = path.read_bytes()
    header = json.loads(json.loads(raw[8:header_span(path)[1]])["__metadata__"]["foretell.header"])
    slots = [s for layer in header["layers"] for s in layer["tensors"].values()]
    assert len(slots) == 4
    for i, slot in enumerate(slots):
        for bit in (0, rng.randrange(8 * (slot["offsets"][1] - slot["offsets"][0]))):
            layout = SingleFileLayout(tmp_path / f"{i}-{bit}", identity=identity)
            layout.write(entry)
            damaged = bytearray(raw)
            damaged[header_span(path)[1] + slot["offsets"][0] + bit // 8] ^= 1 << (bit % 8)
            layout.path(probe.key_for(entry.tokens)).write_bytes(bytes(damaged))
            assert layout.read(layout.key_for(entry.tokens)) is None, (slot["name"], bit)


def test_a_truncated_file_is_never_served(layout, stored):
    _, key = stored
    path = layout.path(key)
    os.truncate(path, path.stat().st_size - 100)
    assert layout.scan() == []
    assert not path.exists() and layout.read(key) is None


def _during_the_read(monkeypatch, act):
    """Run ``act(path)`` right after MLX's loader opened an entry, before it reads bytes."""
    real = mx.load

    def load(path, **kwargs):
        loaded = real(path, **kwargs)
        act(path)
        return loaded

    monkeypatch.setattr(mx, "load", load)


def test_bytes_that_cannot_be_read_are_never_served_and_never_raise(layout, stored,
                                                                    monkeypatch, caplog):
    """The read itself failing (a short file, an I/O error) is damage: not served, the file
    deleted with one warning, nothing raised into the caller."""
    _during_the_read(monkeypatch, lambda path: os.truncate(path, 64))
    with caplog.at_level(logging.WARNING):
        assert layout.read(stored[1]) is None
    assert not layout.path(stored[1]).exists()
    assert sum("corrupt" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("how", ["rewritten", "evicted"])
def test_a_file_replaced_or_removed_while_it_is_read_is_not_taken_for_damage(
        layout, stored, codecs, monkeypatch, caplog, how):
    """Another process's atomic rewrite of the same key, or its eviction, during a read:
    the read serves nothing, warns of nothing, and deletes nothing (the new file stays)."""
    other = SingleFileLayout(layout.directory.parent, identity=layout.identity)

    def act(path):
        if how == "rewritten":
            assert other.write(make_entry(codecs, seed_offset=3))  # same tokens, other bytes
        else:
            os.unlink(path)

    _during_the_read(monkeypatch, act)
    with caplog.at_level(logging.WARNING):
        assert layout.read(stored[1]) is None
    assert layout.path(stored[1]).exists() == (how == "rewritten")
    assert [r.message for r in caplog.records] == []


def test_a_truncated_header_is_never_served(layout, stored):
    _, key = stored
    path = layout.path(key)
    os.truncate(path, 20)
    assert layout.read(key) is None and not path.exists()


def test_an_edited_header_fails_its_hash(layout, stored):
    entry, key = stored
    path = layout.path(key)
    # Same length, valid JSON: only the header hash can tell the token list was changed.
    rewrite(path, b'\\"num_tokens\\":24', b'\\"num_tokens\\":25')
    assert layout.read(key) is None and not path.exists()


def test_a_wrong_header_hash_is_never_served(layout, stored):
    _, key = stored
    path = layout.path(key)
    raw = path.read_bytes()
    digest = json.loads(raw[8:header_span(path)[1]])["__metadata__"]["foretell.header_hash"]
    rewrite(path, digest.encode(), ("f" * 32).encode())
    assert layout.scan() == [] and not path.exists()


def test_a_safetensors_index_that_disagrees_with_the_verified_header_is_never_served(layout, stored):
    _, key = stored
    path = layout.path(key)
    # What a user's tool reads must be what we verified: here the index lies about a dtype.
    rewrite(path, b'"layers.0.keys":{"dtype":"F32"', b'"layers.0.keys":{"dtype":"I32"')
    assert layout.read(key) is None and not path.exists()


def test_a_renamed_file_does_not_answer_for_another_prompt(layout, stored, codecs):
    _, key = stored
    other = layout.key_for(range(5))
    os.link(layout.path(key), layout.path(other))
    assert layout.read(other) is None
    assert layout.read(key) is not None


def test_garbage_is_deleted_on_scan(layout, stored):
    junk = layout.directory / ("0" * 32 + ".safetensors")
    junk.write_bytes(b"\xff" * 64)
    assert [h.key for h in layout.scan()] == [stored[1]]
    assert not junk.exists()


@pytest.mark.parametrize("version", [b"1", b"9"], ids=["crc32-era", "future"])
def test_an_unknown_format_version_is_skipped_and_kept(layout, stored, version):
    _, key = stored
    path = layout.path(key)
    rewrite(path, b'"foretell.format_version":"2"', b'"foretell.format_version":"' + version + b'"')
    assert layout.scan() == []
    assert layout.read(key) is None
    assert path.exists()  # a newer foretell wrote it; not ours to delete


def test_a_rescan_reads_only_the_files_that_are_new_or_changed(layout, codecs, monkeypatch):
    """A re-read of the directory reuses what each unchanged file's header parsed to (its
    inode, size and mtime the same), so the tier can re-read often; a file written, touched
    or removed since is seen."""
    from foretell.store import format as fmt

    kept, touched = make_entry(codecs, n=24), make_entry(codecs, n=20)
    for entry in (kept, touched):
        assert layout.write(entry)
    layout.scan()
    parsed = []
    real = fmt.read_header
    monkeypatch.setattr(fmt, "read_header",
                        lambda fh, *a: parsed.append(os.path.basename(fh.name)) or real(fh, *a))
    assert len(layout.scan()) == 2 and parsed == []
    later = time.time() + 60
    os.utime(layout.path(layout.key_for(touched.tokens)), (later, later))  # another's read
    added = make_entry(codecs, n=16)
    other = SingleFileLayout(layout.directory.parent, identity=layout.identity)
    assert other.write(added)  # another process's write
    headers = layout.scan()
    assert sorted(parsed) == sorted(f"{layout.key_for(e.tokens)}.safetensors"
                                    for e in (touched, added))
    assert headers[-1].key == layout.key_for(touched.tokens)  # its new last use counts
    os.unlink(layout.path(layout.key_for(kept.tokens)))
    assert {h.key for h in layout.scan()} == {layout.key_for(e.tokens) for e in (touched, added)}


def test_overlapping_scans_each_keep_the_changes_made_while_they_ran():
    from foretell.store.layout import ScanJournal

    journal = ScanJournal()
    first, second = journal.begin(), journal.begin()  # equal journals, not the same one
    journal.record("b", None)
    assert journal.finish(second, {"b": "listed"}) == {}
    journal.record("c", "written")  # only the first is still open
    assert journal.finish(first, {"b": "listed"}) == {"c": "written"}


def test_an_update_recorded_during_a_scan_does_not_bring_back_what_it_found_gone():
    from foretell.store.layout import ScanJournal

    journal = ScanJournal()
    changes = journal.begin()
    journal.record("gone", "last use bumped", if_present=True)
    journal.record("kept", "last use bumped", if_present=True)
    assert journal.finish(changes, {"kept": "listed"}) == {"kept": "last use bumped"}


def test_a_write_landing_right_after_a_scans_listing_is_indexed(layout, codecs, monkeypatch):
    """The scan opens its journal before it lists the directory: an entry written by
    another thread just after the listing (so not in it) is in the index the scan swaps in."""
    from foretell.store import single_file

    assert layout.write(make_entry(codecs))
    late = make_entry(codecs, n=16)
    real = single_file.os.listdir

    def listing_then_a_write(path):
        names = real(path)
        assert layout.write(late)
        return names

    monkeypatch.setattr(single_file.os, "listdir", listing_then_a_write)
    layout.scan()
    monkeypatch.setattr(single_file.os, "listdir", real)
    assert layout.key_for(late.tokens) in {h.key for h in layout.headers()}


def test_a_skipped_file_is_reported_at_every_rescan_and_read_once(layout, stored, monkeypatch):
    from foretell.store import format as fmt

    rewrite(layout.path(stored[1]), b'"foretell.format_version":"2"',
            b'"foretell.format_version":"9"')
    assert layout.scan() == [] and list(layout.skipped) == [str(layout.path(stored[1]))]
    monkeypatch.setattr(fmt, "read_header", lambda *a: pytest.fail("read again"))
    assert layout.scan() == [] and list(layout.skipped) == [str(layout.path(stored[1]))]


# -- identity: another model's or tokenizer's file is never served --------------------------


@pytest.mark.parametrize("field,value", [("tokenizer_hash", "tok-bbbb"), ("model_id", "other/model")])
def test_an_entry_of_another_identity_in_the_same_directory_is_never_served(
    tmp_path, layout, stored, identity, field, value
):
    _, key = stored
    other = SingleFileLayout(tmp_path, identity=attrs.evolve(identity, **{field: value}))
    assert other.directory == layout.directory
    assert other.scan() == []
    assert other.read(key) is None
    assert layout.path(key).exists()  # it is still the first identity's entry
    assert layout.read(key) is not None


def test_another_model_fingerprint_or_kv_scheme_uses_another_directory(tmp_path, stored, identity):
    for change in ({"model_fingerprint": "fedcba9876543210"}, {"kv_scheme": "q8"}):
        other = SingleFileLayout(tmp_path, identity=attrs.evolve(identity, **change))
        assert other.scan() == [] and other.read(stored[1]) is None


def test_a_file_copied_into_another_models_directory_is_never_served(tmp_path, layout, stored, identity):
    _, key = stored
    other = SingleFileLayout(tmp_path, identity=attrs.evolve(identity, model_fingerprint="fedcba9876543210"))
    other.directory.mkdir(parents=True)
    os.link(layout.path(key), other.path(key))
    assert other.scan() == [] and other.read(key) is None


def test_an_entry_of_a_codec_not_loaded_is_never_served(tmp_path, stored, identity):
    _, key = stored
    kv_only = attrs.evolve(identity, codec_providers=["foretell.baseline/kv@1"])
    layout = SingleFileLayout(tmp_path, identity=kv_only)
    assert layout.scan() == [] and layout.read(key) is None


def test_identity_refuses_directory_names_that_escape_the_root(identity):
    with pytest.raises(ValueError, match="model_fingerprint"):
        attrs.evolve(identity, model_fingerprint="../x")


# -- atomicity and failing disks ------------------------------------------------------------


def fail_nth(monkeypatch, name: str, n: int, err: int):
    real = getattr(os, name)
    calls = {"n": 0}

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] >= n:
            raise OSError(err, os.strerror(err))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, failing)


def test_a_write_failing_midway_leaves_the_old_entry_and_no_partial_file(layout, codecs, monkeypatch):
    old = make_entry(codecs)
    layout.write(old)
    fail_nth(monkeypatch, "write", 3, errno.EIO)  # header and first tensor written, then failure
    assert layout.write(make_entry(codecs, seed_offset=3)) is False
    monkeypatch.undo()
    assert [f for f in files(layout) if not f.endswith(".safetensors")] == []
    got = layout.read(layout.key_for(old.tokens))
    assert np.array_equal(host(got.layers[0].tensors["keys"]), host(old.layers[0].tensors["keys"]))


@pytest.mark.parametrize("call,err", [("open", errno.EACCES), ("write", errno.ENOSPC),
                                      ("fsync", errno.EIO), ("replace", errno.EROFS)])
def test_a_failing_disk_warns_once_and_never_raises(layout, codecs, monkeypatch, caplog, call, err):
    fail_nth(monkeypatch, call, 1, err)
    with caplog.at_level(logging.DEBUG, logger="foretell.store"):
        assert layout.write(make_entry(codecs, n=10)) is False
        assert layout.write(make_entry(codecs, n=11)) is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk full or unwritable" in warnings[0].getMessage()
    assert layout.io_failures == 2
    monkeypatch.undo()
    assert not any(f.endswith(".tmp") for f in files(layout))
    assert layout.write(make_entry(codecs, n=12)) is True  # keeps working once the disk does
    assert [len(h.tokens) for h in layout.scan()] == [12]


def test_directories_created_for_a_write_are_made_durable_in_their_parents(
        tmp_path, identity, codecs, monkeypatch):
    from foretell.store import files, single_file

    synced = []
    real = files.fsync_directory
    for module in (files, single_file):  # new folders' parents, then the entry's folder
        monkeypatch.setattr(module, "fsync_directory",
                            lambda path: synced.append(Path(path)) or real(path))
    layout = SingleFileLayout(tmp_path / "new" / "cache", identity=identity)
    assert layout.write(make_entry(codecs))
    assert synced == [tmp_path, tmp_path / "new", tmp_path / "new" / "cache",
                      layout.directory]  # each new name, then the entry's


def test_an_unsynced_directory_is_not_claimed_durable(layout, codecs, monkeypatch):
    fail_nth(monkeypatch, "fsync", 2, errno.EIO)  # the file syncs, its directory does not
    assert layout.write(make_entry(codecs)) is False


def test_an_unwritable_root_does_not_raise(tmp_path, identity, codecs, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    layout = SingleFileLayout(blocker, identity=identity)  # mkdir under a file fails
    assert layout.write(make_entry(codecs)) is False
    assert layout.scan() == [] and layout.bytes() == 0


def test_stale_tmp_orphans_are_reaped_on_scan_and_fresh_ones_kept(layout, stored):
    stale = layout.directory / "deadbeef.0000.tmp"
    fresh = layout.directory / "cafebabe.0000.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"in flight")
    old = time.time() - 2 * layout.config.orphan_age_s
    os.utime(stale, (old, old))
    assert [h.key for h in layout.scan()] == [stored[1]]
    assert not stale.exists() and fresh.exists()


# -- byte accounting and garbage collection ------------------------------------------------------------


def age(layout, key, seconds_ago):
    when = time.time() - seconds_ago
    os.utime(layout.path(key), (when, when))


def test_bytes_is_the_size_on_disk(layout, codecs):
    for n in (8, 16, 32):
        layout.write(make_entry(codecs, n=n))
    on_disk = sum(p.stat().st_size for p in layout.directory.glob("*.safetensors"))
    assert layout.bytes() == on_disk
    assert SingleFileLayout(layout.directory.parent, identity=layout.identity).bytes() == on_disk


def test_collect_reaps_stale_orphans_and_never_removes_a_servable_entry(layout, stored):
    stale = layout.directory / "deadbeef.0000.tmp"
    stale.write_bytes(b"x" * 100)
    old = time.time() - 2 * layout.config.orphan_age_s
    os.utime(stale, (old, old))
    assert layout.collect() == 100
    assert not stale.exists()
    assert [h.key for h in layout.scan()] == [stored[1]]


def test_a_read_makes_an_entry_recently_used(layout, codecs):
    first, second = make_entry(codecs, n=10), make_entry(codecs, n=11)
    layout.write(first)
    layout.write(second)
    k1, k2 = layout.key_for(first.tokens), layout.key_for(second.tokens)
    age(layout, k1, 200)
    age(layout, k2, 100)
    layout.scan()
    layout.read(k1)
    assert [h.key for h in layout.headers()] == [k2, k1]


def test_the_layout_conforms_to_the_storage_layout_protocol(layout):
    assert isinstance(layout, StorageLayout)


def test_store_errors_are_foretell_errors():
    for exc in (CorruptEntry, ForeignEntry, UnknownVersion):
        assert issubclass(exc, StoreError) and issubclass(exc, ForetellError)


@pytest.mark.parametrize("value", [-0.5, "1"])
def test_config_errors_name_the_field(value):
    with pytest.raises(FieldError) as info:
        SingleFileConfig(orphan_age_s=value)
    assert info.value.field == "orphan_age_s" and "must be a number >= 0" in info.value.message


def test_the_checksum_is_xxh3_64_over_the_parts_in_order():
    import xxhash

    from foretell.store import format as fmt

    data = bytes(range(256)) * 1000
    assert fmt.checksum(data) == xxhash.xxh3_64_hexdigest(data)
    assert fmt.checksum(data[:1000], memoryview(data)[1000:]) == fmt.checksum(data)
    assert fmt.checksum(b"") == xxhash.xxh3_64_hexdigest(b"") and len(fmt.checksum(b"")) == 16


@pytest.mark.parametrize("parallel", [True, False])
def test_reads_all_at_once_or_one_at_a_time_return_the_same_tensors_and_catch_a_flip(
    tmp_path, identity, codecs, monkeypatch, parallel
):
    """Many-core hosts let MLX read every tensor at once, few-core hosts one at a time
    (store.format.parallel_reads); both serve exactly what was written and neither serves
    a flipped byte."""
    from foretell.store import format as fmt

    monkeypatch.setattr(fmt, "parallel_reads", lambda: parallel)
    entry = make_entry(codecs)
    layout = SingleFileLayout(tmp_path, identity=identity)
    layout.write(entry)
    key = layout.key_for(entry.tokens)
    back = layout.read(key)
    for want, got in zip(entry.layers, back.layers):
        assert want.tensors.keys() == got.tensors.keys()
        for name in want.tensors:
            assert np.array_equal(host(want.tensors[name]), host(got.tensors[name]))
    path = layout.path(key)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10  # the last tensor's bytes: read last, checksummed last
    path.write_bytes(bytes(raw))
    assert layout.read(key) is None
