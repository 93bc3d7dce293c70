"""The block store shares blocks between entries, never rewrites one, counts each once,
collects only what no manifest lists, and serves nothing it cannot verify."""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from blockfill import (
    as_on_cuda,
    assert_same_entry,
    block_files,
    entry_of,
    failing_staging,
    flip_a_byte,
    kv_of,
    listed_blocks,
    manifest_files,
    manifest_header,
    per_thread,
    ring_of,
    sizes,
    token_rows,
)

from foretell.cache.codecs import snapshot_entry
from foretell.cache.quantized import QuantizedKVCache
from foretell.config import FieldError
from foretell.model import KVCache
from foretell.store.entry import StoreIdentity
from foretell.store.layout import CorruptEntry, StorageLayout
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

# -- registration and the contract ----------------------------------------------------------


def test_blocks_layout_is_registered_through_its_entry_point():
    from foretell.plugin import Kind, load_plugins

    registry = load_plugins().registry
    found = registry.get(Kind.LAYOUT, "blocks")
    assert found.origin.plugin == "blockstore"
    assert found.load() is BlockStoreLayout


def test_blocks_layout_conforms_to_the_storage_layout_protocol(layout):
    assert isinstance(layout, StorageLayout)


@pytest.mark.parametrize("field,value", [("block_tokens", 0), ("block_tokens", 2.5),
                                         ("lock_timeout_s", -1)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(FieldError) as info:
        BlockStoreConfig(**{field: value})
    assert info.value.field == field and repr(value) in info.value.message


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_written_entry_reads_back_identical(layout, codecs, dtype):
    entry = entry_of(range(11), codecs, namespace="lora:abc", dtype=dtype)
    assert layout.write(entry) is True
    assert_same_entry(layout.read(layout.key_for(entry.tokens, "lora:abc")), entry)


@pytest.mark.parametrize("many_cores", [False, True], ids=["one-fill-stream", "fill-streams"])
def test_reads_fill_as_the_host_suits_and_serve_the_same(layout, codecs, monkeypatch, many_cores):
    """A host with many cores zero-fills a read's buffers on several CPU streams at once
    (store.format.parallel_reads); both ways serve exactly what was written, and a flipped
    byte is refused either way."""
    from foretell.store import format as fmt
    from foretell_blockstore import manifest as mf

    monkeypatch.setattr(fmt, "parallel_reads", lambda: many_cores)
    assert len(mf._fill_streams()) == (mf.FILL_STREAMS if many_cores else 1)
    entry = entry_of(range(1100), codecs)  # three blocks of each layer's tensors
    assert layout.write(entry) is True
    key = layout.key_for(entry.tokens)
    assert_same_entry(layout.read(key), entry)
    flip_a_byte(layout.block_path(_a_block(layout, 1)))
    assert layout.read(key) is None


def test_reads_on_another_thread_fill_on_the_same_streams(layout, codecs, monkeypatch):
    """The fill streams a many-core host's reads use are made once, by whichever thread
    reads first; a read on another thread uses them too (MLX streams are per thread unless
    made thread-local)."""
    import threading

    from foretell.store import format as fmt
    from foretell_blockstore import manifest as mf

    monkeypatch.setattr(fmt, "parallel_reads", lambda: True)
    monkeypatch.setattr(mf, "_STREAMS", [])
    entry = entry_of(range(600), codecs)
    assert layout.write(entry) is True
    key = layout.key_for(entry.tokens)
    assert_same_entry(layout.read(key), entry)  # this thread makes the streams
    found = []
    worker = threading.Thread(target=lambda: found.append(layout.read(key)))
    worker.start()
    worker.join()
    assert found and found[0] is not None
    assert_same_entry(found[0], entry)


def test_a_piece_checksum_is_its_runs_bytes_hashed_as_one():
    """A reader that lands a piece in one staging slot hashes it in one call; one that reads
    it into its tensor hashes the runs there: the same digest, or a staged read would refuse
    every entry."""
    import random

    import xxhash

    from foretell.store import format as fmt

    data = random.Random(0).randbytes(40_000)
    runs = [memoryview(data)[i:i + 4096] for i in range(0, len(data), 4096)]
    assert fmt.checksum(*runs) == f"{xxhash.xxh3_64_intdigest(data):016x}"
    assert fmt.checksum(*runs[:1]) == f"{xxhash.xxh3_64_intdigest(runs[0]):016x}"
    assert fmt.checksum(*runs[::-1]) != fmt.checksum(*runs)


def _host_staging(monkeypatch, *, landing: bool) -> tuple[list[int], list[int]]:
    """The host staging stands in for the GPU's (``foretell.platform.cuda``), one per reader
    thread, with buffers made on the host; ``landing``: whether reads take it. Returns the
    bytes of each piece sent (its slot holding exactly its runs' bytes) and, at each wait
    for a block's copies, how many pieces had been sent."""

    from foretell.platform.cuda.driver import Staging
    from foretell_blockstore import manifest as mf

    sent, finished, host_buffers = [], [], mf.host_buffers

    class Counting(Staging):
        def send(self, slot, runs):
            sent.append(sum(run.nbytes for run in runs))
            assert slot.nbytes == sent[-1]
            super().send(slot, runs)

        def finish(self):
            finished.append(len(sent))

    # Piece by piece (landing whole: test_landing.py); writes read on the host: by DMA they
    # would wait on the same staging and count as reads' waits.
    as_on_cuda(monkeypatch, gpu_landing=landing, staging=per_thread(Counting))
    monkeypatch.setattr(mf, "host_buffers", lambda specs, on_gpu, reserve=None: host_buffers(specs))
    return sent, finished


def test_a_staged_read_serves_exactly_what_was_written_and_refuses_a_flipped_byte(
        layout, codecs, monkeypatch):
    """On a CUDA GPU each piece is read into the reader thread's staging slot, copied into
    its tensor's runs by the staging (foretell.platform.cuda, by DMA) and hashed there. Here
    the host staging stands in for the GPU's: every piece goes through it, into the right
    places, and a damaged block is still refused."""
    sent, finished = _host_staging(monkeypatch, landing=True)
    entry = entry_of(range(1100), codecs, dtype=mx.bfloat16)
    assert layout.write(entry) is True
    key = layout.key_for(entry.tokens)
    assert_same_entry(layout.read(key), entry)
    tensor_bytes = sum(a.nbytes for layer in entry.layers for a in layer.tensors.values())
    assert sum(sent) == tensor_bytes and len(sent) > len(entry.layers)
    assert len(finished) == len(layout._load_manifest(key).blocks)  # one wait per block
    flip_a_byte(layout.block_path(_a_block(layout, 1)))
    assert layout.read(key) is None


@pytest.mark.parametrize("staged", [False, True])
def test_a_read_takes_consecutive_pieces_in_one_call_up_to_a_slot(layout, codecs, monkeypatch,
                                                                   staged):
    """A staged reader reads as many consecutive pieces as fit one staging slot in one call
    (on the H200, 604 MB landed in 46 ms in reads of 4 MiB against 73 in reads of 1 MiB),
    each piece still copied and checked on its own: with slots of one byte every piece is a
    read of its own, with large ones each block is its header and one read. A reader that
    lands pieces straight in their tensors reads one at a time (it hashes each while still
    in the cache). All serve exactly what was written; a byte flipped in a piece past the
    first read is refused."""
    import os as os_module

    from foretell.platform.cuda.driver import Staging
    from foretell_blockstore import blockfile

    reads, preadv = [], os_module.preadv

    def counted(fd, buffers, offset):
        reads.append(offset)
        return preadv(fd, buffers, offset)

    sent, _finished = _host_staging(monkeypatch, landing=staged)
    monkeypatch.setattr(blockfile.os, "preadv", counted)
    entry = entry_of(range(1100), codecs, dtype=mx.bfloat16)
    assert layout.write(entry) is True
    key = layout.key_for(entry.tokens)
    blocks = len(layout._load_manifest(key).blocks)
    for slot_bytes in (1, 64 << 20):
        monkeypatch.setattr(Staging, "SLOT_BYTES", slot_bytes)
        reads.clear()
        sent.clear()
        assert_same_entry(layout.read(key), entry)
        pieces = 2 * len(entry.layers) * blocks  # K and V of every layer, in every block
        assert len(reads) == blocks + (blocks if staged and slot_bytes > 1 else pieces)
        assert len(sent) == (pieces if staged else 0)  # copied piece by piece either way
    monkeypatch.setattr(Staging, "SLOT_BYTES", 1 << 10)
    flip_a_byte(layout.block_path(_a_block(layout, 1)))
    assert layout.read(key) is None


def test_opening_a_layout_decides_the_gpu_landing_only_where_mlx_is_loaded(tmp_path):
    """A layout opening where an engine runs loads the CUDA driver (and pins the staging
    arena) then, on a CUDA GPU, not on the first restore; elsewhere it imports no CUDA
    module. One opened by a process without MLX, such as `foretell cache ls`, loads neither
    MLX nor anything of CUDA's."""
    import subprocess

    script = (
        "import sys\n"
        "from foretell.store.entry import StoreIdentity\n"
        "from foretell_blockstore.layout import BlockStoreLayout\n"
        "identity = StoreIdentity(model_fingerprint='0' * 16, model_id='m',\n"
        "                         tokenizer_hash='none', codec_providers=[])\n"
        "if sys.argv[1] == 'engine':\n"
        "    from foretell.platform import blas; blas.preload(); import mlx.core\n"
        "BlockStoreLayout(sys.argv[2], identity=identity)\n"
        "cuda = sys.modules.get('foretell.platform.cuda')\n"
        "print('mlx.core' in sys.modules, cuda is not None and len(cuda.driver._DRIVER))\n"
    )
    from foretell.platform import device

    engine = "True 1" if device.on_cuda() else "True False"
    for where, expected in (("cli", "False False"), ("engine", engine)):
        out = subprocess.run([sys.executable, "-c", script, where, str(tmp_path / where)],
                             capture_output=True, text=True, check=True).stdout.split()
        assert " ".join(out[-2:]) == expected, where


def test_a_failed_copy_to_the_gpu_serves_nothing_and_keeps_the_entry(
        layout, codecs, monkeypatch, caplog):
    """A CUDA driver call that fails mid-read is the device's fault, not the files': the read
    is not served, and the entry stays for the next read (a damaged block would be dropped).
    Every block still waits for the copies it sent before the read returns."""
    from foretell_blockstore import manifest as mf

    failing, finished = failing_staging("send", "cuMemcpy2DAsync")
    host_buffers = mf.host_buffers
    cuda = as_on_cuda(monkeypatch, staging=failing)  # piece by piece; only reads' waits
    monkeypatch.setattr(mf, "host_buffers", lambda specs, on_gpu, reserve=None: host_buffers(specs))
    entry = entry_of(range(600), codecs)
    assert layout.write(entry) is True
    key = layout.key_for(entry.tokens)
    blocks = len(layout._load_manifest(key).blocks)
    with caplog.at_level(logging.WARNING):
        assert layout.read(key) is None
    assert "cuMemcpy2DAsync failed" in caplog.text
    # Each block waited for its copies before giving up, so none can land in buffers that
    # are freed (and reused) after the failed read.
    assert len(finished) == blocks
    monkeypatch.setattr(cuda.driver, "gpu_landing", lambda: False)
    assert_same_entry(layout.read(key), entry)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_strided_tensors_are_stored_as_their_bytes_and_named_like_a_contiguous_copy(
        tmp_path, identity, codecs, layout, dtype):
    import attrs

    entry = entry_of(range(11), codecs, dtype=dtype)
    # The same values held transposed in memory: no run of rows is contiguous.
    strided = attrs.evolve(entry, layers=[
        attrs.evolve(la, tensors={n: mx.contiguous(mx.swapaxes(a, -1, -2)).swapaxes(-1, -2)
                                  for n, a in la.tensors.items()}) for la in entry.layers])
    assert not memoryview(strided.layers[0].tensors["keys"]).c_contiguous
    assert layout.write(strided)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    plain = BlockStoreLayout(tmp_path / "plain", layout.config, identity=identity)
    assert plain.write(entry)
    assert listed_blocks(plain, entry) == listed_blocks(layout, entry)


def test_a_fresh_layout_reads_what_another_wrote(tmp_path, identity, codecs, layout):
    entry = entry_of(range(9), codecs)
    layout.write(entry)
    other = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
    [header] = other.scan()
    assert header.tokens == entry.tokens and header.layers[0].meta == {"offset": 9}
    assert_same_entry(other.read(header.key), entry)


def test_a_wrapped_ring_round_trips_with_its_write_index(layout, codecs):
    ring = ring_of(23, max_size=10)
    assert ring.offset > ring.max_size  # wrapped: slots are not positions
    entry = snapshot_entry(range(23), [kv_of(range(23))[0], ring], codecs)
    assert layout.write(entry)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)


def test_quantized_kv_round_trips(layout, codecs):
    cache = QuantizedKVCache(bits=4, group_size=32)
    keys = mx.random.normal((1, 2, 13, 64), key=mx.random.key(1))
    cache.update_and_fetch(keys, keys * 0.5)
    entry = snapshot_entry(range(13), [cache], codecs)
    assert {t.dtype for t in entry.layers[0].tensors.values()} >= {mx.uint32}
    assert layout.write(entry)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)


def test_a_piece_of_small_runs_is_packed_into_one_and_hashes_and_writes_the_same(codecs):
    """Quantized KV's scales and biases are a few bytes a row: each such piece becomes one
    buffer before it is hashed and written (a hash update and a write per run made the GIL
    change hands thousands of times per block); large runs stay views. The block's bytes,
    its name and its checksum are those of the runs laid end to end either way."""
    import numpy as np

    from foretell_blockstore import manifest as mf

    cache = QuantizedKVCache(bits=8, group_size=64)
    keys = mx.random.normal((1, 4, 600, 256), key=mx.random.key(2)).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys * 0.5)
    entry = snapshot_entry(range(600), [cache], codecs)
    hosts = mf.host_views(entry)
    [group] = mf.plan_groups(entry)
    pieces = mf.block_pieces(hosts, group, 0, 512)
    for spec, runs in zip(group.tensors, pieces):
        rows = hosts[(spec.layer, spec.name)].reshape(-1, 600, spec.shape[-1])[:, :512, :]
        assert b"".join(bytes(run) for run in runs) == np.ascontiguousarray(rows).tobytes()
        small = rows[0].nbytes < mf.PACK_RUNS_BELOW
        assert len(runs) == (1 if small else 4), spec.name
    assert {len(runs) for runs in pieces} == {1, 4}  # 8-bit 256-dim keys: 128 KiB runs, views
    header = mf.block_header(group, 0, 512)
    unpacked = [[memoryview(np.ascontiguousarray(r)).cast("B") for r in hosts[(
        s.layer, s.name)].reshape(-1, 600, s.shape[-1])[:, :512, :]] for s in group.tensors]
    assert mf.block_ref(header, pieces) == mf.block_ref(header, unpacked)


def test_a_block_is_written_in_writes_of_about_a_mebibyte_and_survives_short_ones(
        tmp_path, monkeypatch):
    from foretell_blockstore import blockfile

    chunks = [bytes([i]) * size for i, size in enumerate([100, 700_000, 700_000, 3_000_000, 5])]
    calls, writev = [], os.writev

    def short(fd, buffers):  # the kernel may write less than asked: 1,000 bytes at most
        calls.append([len(b) for b in buffers])
        return writev(fd, [memoryview(b"".join(bytes(b) for b in buffers))[:1000]])

    monkeypatch.setattr(blockfile.os, "writev", short)
    path = tmp_path / "block"
    blockfile.write_durably(path, *chunks)
    assert path.read_bytes() == b"".join(chunks)
    assert calls == [[100, 700_000], [700_000], [3_000_000], [5]]


def test_layers_without_tensors_and_empty_caches_round_trip(layout, codecs):
    entry = snapshot_entry([], kv_of([]), codecs)
    assert layout.write(entry)
    assert_same_entry(layout.read(layout.key_for(())), entry)


def test_manifest_is_a_safetensors_file_that_describes_its_blocks(layout, codecs):
    from safetensors import safe_open

    layout.write(entry_of(range(10), codecs))
    [path] = manifest_files(layout)
    with safe_open(str(path), framework="numpy") as f:
        assert list(f.keys()) == []
        header = json.loads(f.metadata()["foretell.header"])
    assert header["block_rows"] == 4 and header["num_tokens"] == 10
    [group] = header["groups"]
    assert group["rows"] == 10 and len(group["blocks"]) == 3  # rows 0-3, 4-7, 8-9
    assert {b[0] for b in group["blocks"]} <= block_files(layout)


def test_a_block_is_a_safetensors_file_of_its_pieces(layout, codecs):
    import numpy as np
    from safetensors import safe_open

    entry = entry_of(range(10), codecs)
    layout.write(entry)
    second = listed_blocks(layout, entry)[1]  # rows 4-7 of every tensor
    with safe_open(str(layout.block_path(second)), framework="numpy") as f:
        assert f.metadata() == {"foretell.block": "blocks/4"}
        pieces = [f.get_tensor(str(i)) for i in range(4)]  # 2 layers x keys, values
    want = [np.asarray(layer.tensors[name][..., 4:8, :])
            for layer in entry.layers for name in ("keys", "values")]
    assert all(np.array_equal(a, b) for a, b in zip(pieces, want))


def test_a_block_is_named_by_the_xxh3_128_of_its_file_and_its_manifest_says_so(layout, codecs):
    import xxhash

    entry = entry_of(range(10), codecs)
    layout.write(entry)
    assert manifest_header(layout)["block_id"] == "xxh3-128"
    for name in listed_blocks(layout, entry):
        assert name == xxhash.xxh3_128(layout.block_path(name).read_bytes()).hexdigest()


def test_an_entry_whose_blocks_are_named_by_sha256_reads_as_written(
        tmp_path, identity, codecs, monkeypatch):
    """Manifests written before XXH3-128 named the blocks (SHA-256, ``block_id: sha256``)
    stay readable: a read checks sizes and checksums, never recomputes a name."""
    import hashlib

    from foretell_blockstore import manifest as mf

    older = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
    monkeypatch.setattr(mf, "BLOCK_NAMING", "sha256")
    entry = entry_of(range(10), codecs)
    assert older.write(entry)
    monkeypatch.undo()
    names = listed_blocks(older, entry)
    assert all(n == hashlib.sha256(older.block_path(n).read_bytes()).hexdigest() for n in names)
    now = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
    [header] = now.scan()
    assert_same_entry(now.read(header.key), entry)
    # The same bytes written now are named anew (no dedup across the two namings).
    now.write(entry_of(range(12), codecs))
    assert not set(listed_blocks(now, entry_of(range(12), codecs))) & set(names)


def test_a_manifest_naming_its_blocks_by_an_unknown_hash_is_skipped_and_kept(
        tmp_path, identity, layout, codecs, monkeypatch, caplog):
    from foretell_blockstore import manifest as mf

    monkeypatch.setitem(mf.NAMINGS, "future-hash", mf.NAMINGS["xxh3-128"])
    monkeypatch.setattr(mf, "BLOCK_NAMING", "future-hash")
    entry = entry_of(range(10), codecs)
    assert layout.write(entry)
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        fresh = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
        assert fresh.scan() == []
        assert fresh.read(layout.key_for(entry.tokens)) is None
    assert manifest_files(layout)  # another version's entry: never served, never deleted


# -- sharing --------------------------------------------------------------------------------


def test_entries_sharing_a_prefix_share_its_whole_blocks(layout, codecs):
    first, second = entry_of(range(12), codecs), entry_of([*range(9), 50, 51, 52, 53], codecs)
    layout.write(first)
    before, written = block_files(layout), layout.bytes_written
    layout.write(second)
    # Blocks of rows 0-3 and 4-7 are shared; rows 8-11 and 12 differ.
    shared = set(listed_blocks(layout, second)) & before
    assert shared == set(listed_blocks(layout, first)[:2])
    assert layout.bytes_reused == sizes(layout, shared)
    assert layout.bytes_written - written == sizes(layout, block_files(layout) - before)
    assert len(block_files(layout) - before) == 2
    usage = layout.usage()
    assert usage.logical_bytes > usage.disk_bytes == layout.bytes()
    assert usage.dedup_ratio > 1


def test_a_growing_conversation_only_adds_blocks_and_never_rewrites_one(layout, codecs):
    layout.write(entry_of(range(8), codecs))
    stats = {name: os.stat(layout.block_path(name)) for name in block_files(layout)}
    layout.write(entry_of(range(14), codecs))
    assert len(block_files(layout)) == len(stats) + 2  # rows 8-11 and 12-13
    for name, stat in stats.items():
        now = os.stat(layout.block_path(name))
        assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)


def test_a_later_checkpoint_of_a_wrapped_ring_reuses_its_unchanged_slot_ranges(layout, codecs):
    ring = ring_of(14, max_size=12)
    first = snapshot_entry(range(14), [ring], codecs)
    layout.write(first)
    for _ in range(14, 16):  # two more tokens overwrite slots 2 and 3 only
        ring.update_and_fetch(*(2 * [mx.ones((1, 2, 1, 8))]))
    before, reused = block_files(layout), layout.bytes_reused
    second = snapshot_entry(range(16), [ring], codecs)
    layout.write(second)
    # Slot ranges 4-7 and 8-11 are unchanged; slots 0-3 are a new block.
    assert listed_blocks(layout, second)[1:] == listed_blocks(layout, first)[1:]
    assert len(block_files(layout) - before) == 1
    assert layout.bytes_reused - reused == sizes(layout, listed_blocks(layout, first)[1:])
    assert_same_entry(layout.read(layout.key_for(second.tokens)), second)


def test_bytes_counts_each_unique_block_once(layout, codecs):
    for n in (8, 12, 16):
        layout.write(entry_of(range(n), codecs))
    on_disk = sum(os.path.getsize(layout.block_path(b)) for b in block_files(layout))
    manifests = sum(p.stat().st_size for p in manifest_files(layout))
    assert layout.bytes() == on_disk + manifests
    assert sum(h.nbytes for h in layout.headers()) > layout.bytes()


# -- remove and collect ---------------------------------------------------------------------


def test_collect_deletes_only_blocks_no_manifest_lists(layout, codecs):
    short, long = entry_of(range(8), codecs), entry_of(range(16), codecs)
    layout.write(short)
    layout.write(long)
    shared = block_files(layout)
    assert layout.remove(layout.key_for(long.tokens))
    assert layout.collect() > 0
    assert len(block_files(layout)) == 2  # the short entry's two blocks
    assert block_files(layout) < shared
    assert_same_entry(layout.read(layout.key_for(short.tokens)), short)


def test_collect_keeps_blocks_another_process_still_uses(tmp_path, identity, codecs, layout):
    entry = entry_of(range(8), codecs)
    other = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
    layout.scan()
    other.write(entry)  # this layout's index has never seen it
    layout.collect()
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)


def test_collect_keeps_blocks_of_a_foreign_identitys_manifest(tmp_path, identity, codecs, layout):
    foreign = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4),
                               identity=StoreIdentity(**{**_fields(identity), "model_id": "x"}))
    entry = entry_of(range(8), codecs)
    foreign.write(entry)
    layout.collect()
    assert_same_entry(foreign.read(foreign.key_for(entry.tokens)), entry)


def test_collect_follows_a_rewritten_manifest(layout, codecs):
    layout.write(entry_of(range(8), codecs))
    layout.collect()  # parses (and remembers) the first version
    old = block_files(layout)
    rewrite = entry_of(range(8), codecs, dtype=mx.bfloat16)  # same key, other bytes
    layout.write(rewrite)
    layout.collect()
    assert block_files(layout) == set(listed_blocks(layout, rewrite)) and not old & block_files(layout)
    assert_same_entry(layout.read(layout.key_for(rewrite.tokens)), rewrite)


def test_a_read_racing_remove_and_collect_returns_none_quietly(layout, codecs, caplog,
                                                                monkeypatch):
    entry = entry_of(range(8), codecs)
    layout.write(entry)
    key = layout.key_for(entry.tokens)
    parse = layout._manifest_of

    def parse_then_lose_the_race(k, raw):
        manifest = parse(k, raw)
        layout.remove(k)  # another thread evicts the entry and collects its blocks
        layout.collect()
        return manifest

    monkeypatch.setattr(layout, "_manifest_of", parse_then_lose_the_race)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.read(key) is None
    assert not caplog.records


@pytest.mark.parametrize("reaper", ["collect", "scan"])
def test_interrupted_writes_are_reaped_when_no_write_is_in_flight(layout, codecs, reaper):
    layout.write(entry_of(range(8), codecs))

    (layout.data_dir / ("0" * 64 + ".abc.tmp")).write_bytes(b"partial")
    (layout.entries_dir / "k.abc.tmp").write_bytes(b"partial")
    if reaper == "scan":  # scan never waits: with a write in flight its tmp files may be live
        with layout._flock(exclusive=False):
            layout.scan()
        assert len(list(layout.directory.rglob("*.tmp"))) == 2
    getattr(layout, reaper)()
    assert not list(layout.directory.rglob("*.tmp"))
    assert_same_entry(layout.read(layout.key_for(range(8))), entry_of(range(8), codecs))


def test_collect_waits_for_a_write_in_flight_and_then_skips(layout, codecs):
    quick = BlockStoreLayout(layout.directory.parent.parent, BlockStoreConfig(
        block_tokens=4, lock_timeout_s=0.05), identity=layout.identity)
    quick.write(entry_of(range(8), codecs))
    quick.remove(quick.key_for(range(8)))
    with layout._flock(exclusive=False):  # a writer between its blocks and its manifest
        assert quick.collect() == 0
        assert len(block_files(quick)) == 2
    assert quick.collect() > 0


def test_without_flock_writes_work_and_collect_deletes_nothing(layout, codecs, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows: import fails
    entry = entry_of(range(8), codecs)
    assert layout.write(entry)
    layout.write(entry_of(range(12), codecs))
    layout.remove(layout.key_for(range(12)))
    assert layout.collect() == 0 and len(block_files(layout)) == 3
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)


# -- damage: never served, never a crash ------------------------------------------------------


@pytest.fixture
def stored(layout, codecs):
    entry = entry_of(range(10), codecs)
    assert layout.write(entry)
    return entry, layout.key_for(entry.tokens)


def test_a_rescan_reads_only_the_manifests_that_are_new_or_changed(layout, codecs,
                                                                   monkeypatch):
    """A re-read of the directory reuses what each unchanged manifest parsed to (its inode,
    size and mtime the same) and does not look for its blocks again; a manifest written,
    touched or removed since is seen."""
    kept, touched = entry_of(range(10), codecs), entry_of(range(50, 58), codecs)
    for entry in (kept, touched):
        assert layout.write(entry)
    layout.scan()
    loaded = []
    real = layout._manifest_bytes
    monkeypatch.setattr(layout, "_manifest_bytes", lambda key: loaded.append(key) or real(key))
    looked = []
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: looked.append(p) or real_exists(p))
    assert len(layout.scan()) == 2 and loaded == [] and looked == []
    later = time.time() + 60
    os.utime(layout.path(layout.key_for(touched.tokens)), (later, later))  # another's read
    added = entry_of(range(100, 106), codecs)
    assert BlockStoreLayout(layout.directory.parent.parent, layout.config,
                            identity=layout.identity).write(added)  # another process's
    headers = layout.scan()
    assert sorted(loaded) == sorted(layout.key_for(e.tokens) for e in (touched, added))
    assert headers[-1].key == layout.key_for(touched.tokens)  # its new last use counts
    os.unlink(layout.path(layout.key_for(kept.tokens)))
    assert {h.key for h in layout.scan()} == {layout.key_for(e.tokens) for e in (touched, added)}


def test_a_block_lost_under_an_unchanged_manifest_is_caught_by_the_read(layout, stored):
    layout.scan()
    os.unlink(layout.block_path(_a_block(layout)))
    assert [h.key for h in layout.scan()] == [stored[1]]  # not looked for again
    assert layout.read(stored[1]) is None and not layout.path(stored[1]).exists()


def test_a_manifest_lands_only_after_the_blocks_names_are_durable_even_when_all_existed(
        layout, codecs, monkeypatch):
    """Blocks another writer renamed in may not be durable yet (its directory fsync pending,
    or failed): a manifest listing them, all reused, still fsyncs the blocks' directory
    before it is renamed in."""
    from foretell_blockstore import layout as module

    assert layout.write(entry_of(range(10), codecs))
    events = []
    real_sync, real_replace = module.fsync_directory, os.replace
    monkeypatch.setattr(module, "fsync_directory",
                        lambda path: events.append(("sync", Path(path).name)) or real_sync(path))
    monkeypatch.setattr(module.os, "replace",
                        lambda a, b: events.append(("rename", Path(b).parent.name))
                        or real_replace(a, b))
    assert layout.write(entry_of(range(10), codecs, namespace="again"))  # every block reused
    assert layout.bytes_reused and events == [("sync", "data"), ("rename", "entries"),
                                              ("sync", "entries")]


def test_a_read_racing_a_rewrite_of_its_key_drops_nothing_of_the_rewrite(layout, codecs,
                                                                          monkeypatch):
    """Between a read's manifest and its blocks, another process rewrites the key with
    other blocks (another block size) and collects the old ones: the read finds a block
    missing and serves nothing, but the new manifest is not at fault and stays."""
    entry = entry_of(range(16), codecs)
    key = layout.key_for(entry.tokens)
    assert layout.write(entry)
    other = BlockStoreLayout(layout.directory.parent.parent, BlockStoreConfig(block_tokens=8),
                             identity=layout.identity)
    real = layout._assemble

    def rewritten_meanwhile(manifest, **kwargs):
        assert other.write(entry) and other.collect() > 0
        return real(manifest, **kwargs)

    monkeypatch.setattr(layout, "_assemble", rewritten_meanwhile)
    assert layout.read(key) is None
    assert_same_entry(other.read(key), entry)


def test_a_damaged_block_goes_even_when_its_manifest_was_rewritten_meanwhile(
        layout, stored, codecs, monkeypatch):
    """A block that fails its checksum is damaged whichever manifest lists it: deleted,
    not left for the rewrite of the same state (which reuses stored blocks) to list."""
    bad = _a_block(layout)
    flip_a_byte(layout.block_path(bad))
    real = layout._assemble

    def rewritten_meanwhile(manifest, **kwargs):
        os.utime(layout.path(stored[1]), (1, 1))
        layout.path(stored[1]).write_bytes(layout.path(stored[1]).read_bytes() + b" ")
        return real(manifest, **kwargs)

    monkeypatch.setattr(layout, "_assemble", rewritten_meanwhile)
    assert layout.read(stored[1]) is None
    assert not layout.block_path(bad).exists()


def test_collect_keeps_the_blocks_of_a_rewrite_whose_inode_size_and_time_repeat(
        layout, codecs, monkeypatch):
    """collect() chooses what to delete by what the manifests list, so it reads them anew
    each time: a rewrite of a key can come back with the inode, size and mtime the old
    manifest had (a freed inode reused within one timestamp tick), and its blocks are
    live all the same."""
    from foretell_blockstore import layout as module

    tokens = list(range(8))
    assert layout.write(entry_of(tokens, codecs))
    layout.collect()
    path = layout.path(layout.key_for(tokens))
    before = os.stat(path)
    other = [KVCache() for _ in range(2)]
    for i, cache in enumerate(other):
        rows = token_rows(tokens, i) * 3  # the same tokens, other bytes: other blocks
        cache.update_and_fetch(rows, rows)
    rewrite = snapshot_entry(tokens, other, codecs)
    assert BlockStoreLayout(layout.directory.parent.parent, layout.config,
                            identity=layout.identity).write(rewrite)
    real_stat = os.stat
    monkeypatch.setattr(module.os, "stat", lambda p, *a, **k: before if Path(p) == path
                        else real_stat(p, *a, **k))
    layout.collect()
    monkeypatch.setattr(module.os, "stat", real_stat)
    assert_same_entry(layout.read(layout.key_for(tokens)), rewrite)


def _a_block(layout, index=0) -> str:
    return manifest_header(layout)["groups"][0]["blocks"][index][0]


@pytest.mark.parametrize("where", [-5, 20], ids=["tensor-bytes", "block-header"])
def test_a_flipped_block_byte_is_never_served(layout, stored, caplog, where):
    _entry, key = stored
    path = layout.block_path(_a_block(layout))
    raw = bytearray(path.read_bytes())
    raw[where] ^= 0x40
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.read(key) is None
        assert layout.read(key) is None
    assert len([r for r in caplog.records if "dropped" in r.message]) == 1
    assert not manifest_files(layout) and not path.exists()


def test_a_single_flipped_bit_in_any_piece_of_any_block_is_caught(tmp_path, identity, codecs):
    import random

    rng = random.Random(0)
    entry = entry_of(range(10), codecs)  # 3 blocks of 4 tokens, 4 pieces each
    config = BlockStoreConfig(block_tokens=4)
    for block in range(3):
        for piece in range(4):
            layout = BlockStoreLayout(tmp_path / f"{block}-{piece}", config, identity=identity)
            layout.write(entry)
            path = layout.block_path(listed_blocks(layout, entry)[block])
            raw = bytearray(path.read_bytes())
            (length,) = struct.unpack("<Q", raw[:8])
            index = json.loads(raw[8:8 + length])
            begin, end = index[str(piece)]["data_offsets"]
            bit = rng.randrange(8 * (end - begin))
            raw[8 + length + begin + bit // 8] ^= 1 << (bit % 8)
            path.write_bytes(bytes(raw))
            assert layout.read(layout.key_for(entry.tokens)) is None, (block, piece, bit)


def test_the_benchmarks_unverified_read_skips_only_checksums_and_serving_still_refuses(
        layout, stored):
    entry, key = stored
    path = layout.block_path(_a_block(layout))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # a tensor byte of the block's last piece
    path.write_bytes(bytes(raw))
    # Unverified (the cache bench's row only): the damaged byte comes back, nothing dropped.
    damaged = layout.read_layers(key, verify=False)
    assert any(not mx.array_equal(damaged[i].tensors[name], tensor)
               for i, layer in enumerate(entry.layers) for name, tensor in layer.tensors.items())
    assert manifest_files(layout) and path.exists()
    with pytest.raises(CorruptEntry, match="fails its checksum"):
        layout.read_layers(key)
    assert layout.read(key) is None  # what serving calls: refused and dropped
    assert not manifest_files(layout) and not path.exists()


def test_the_unverified_read_still_refuses_a_block_of_another_header(layout, stored):
    _entry, key = stored
    path = layout.block_path(_a_block(layout))
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptEntry, match="another header"):
        layout.read_layers(key, verify=False)


def test_files_lists_the_manifest_then_every_block_a_read_opens(layout, stored):
    _entry, key = stored
    files = layout.files(key)
    assert files[0] == layout.path(key)
    assert files[1:] == [layout.block_path(ref) for ref in listed_blocks(layout, stored[0])]
    [header] = layout.headers()
    assert sum(f.stat().st_size for f in files) == header.nbytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice: Linux")
def test_blocks_are_written_at_the_write_niceness_and_read_at_the_callers(layout, codecs,
                                                                           monkeypatch):
    import threading

    from foretell.store import format as fmt
    from foretell_blockstore import blockfile

    def niceness():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    caller, seen = niceness(), {"write": set(), "read": set()}
    store_block, open_block = BlockStoreLayout._store_block, blockfile.open_block
    monkeypatch.setattr(BlockStoreLayout, "_store_block", lambda self, *a: (
        seen["write"].add(niceness()), store_block(self, *a))[1])
    monkeypatch.setattr(blockfile, "open_block", lambda *a: (  # every read, whole or by piece
        seen["read"].add(niceness()), open_block(*a))[1])
    entry = entry_of(range(10), codecs)
    assert layout.write(entry)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert seen == {"write": {max(caller, fmt.WRITE_NICENESS)}, "read": {caller}}


def test_a_truncated_block_is_never_served(layout, stored):
    path = layout.block_path(_a_block(layout, 1))
    path.write_bytes(path.read_bytes()[:-3])
    assert layout.read(stored[1]) is None


def test_a_missing_block_is_never_served_and_drops_the_entry_on_scan(layout, stored, caplog):
    os.unlink(layout.block_path(_a_block(layout, 2)))
    fresh = BlockStoreLayout(layout.directory.parent.parent, layout.config,
                             identity=layout.identity)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert fresh.scan() == []
    assert any("missing" in r.message for r in caplog.records)
    assert layout.read(stored[1]) is None


def test_a_foreign_block_under_one_of_our_names_is_never_served(layout, stored, codecs):
    other = entry_of([7] * 10, codecs)  # same shapes, other bytes
    layout.write(other)
    mine, theirs = _a_block_of(layout, stored[0]), _a_block_of(layout, other)
    layout.block_path(mine).write_bytes(layout.block_path(theirs).read_bytes())
    assert layout.read(stored[1]) is None
    assert_same_entry(layout.read(layout.key_for(other.tokens)), other)


def _a_block_of(layout, entry) -> str:
    raw = layout.path(layout.key_for(entry.tokens)).read_bytes()
    header = json.loads(json.loads(raw[8:])["__metadata__"]["foretell.header"])
    return header["groups"][0]["blocks"][0][0]


def test_every_entry_sharing_a_damaged_block_is_refused(layout, stored, codecs):
    longer = entry_of(range(14), codecs)
    layout.write(longer)
    path = layout.block_path(_a_block_of(layout, stored[0]))
    path.write_bytes(b"\0" * path.stat().st_size)
    assert layout.read(stored[1]) is None
    assert layout.read(layout.key_for(longer.tokens)) is None
    # The damaged block is gone, so the next write of those bytes stores them afresh.
    assert layout.write(longer) and layout.read(layout.key_for(longer.tokens)) is not None


def test_an_edited_manifest_fails_its_hash(layout, stored):
    path = layout.path(stored[1])
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'\\"num_tokens\\":10', b'\\"num_tokens\\":11', 1))
    assert raw != path.read_bytes()
    assert layout.read(stored[1]) is None and not path.exists()


def test_a_read_parses_no_manifest_whose_bytes_were_verified_already(layout, stored,
                                                                     monkeypatch):
    """The scan verified the manifest; a read that finds the very same bytes serves from
    that parse (and still verifies every block)."""
    from foretell_blockstore import manifest as mf

    layout.scan()
    parsed = []
    real = mf.parse
    monkeypatch.setattr(mf, "parse", lambda raw: parsed.append(raw) or real(raw))
    served = layout.read(stored[1])
    assert served is not None and parsed == []
    assert_same_entry(served, stored[0])


def test_a_manifest_changed_in_place_after_the_scan_is_verified_again(layout, stored):
    """Same size, same modification time, other bytes: parsed and checked again, and the
    edit is caught (not served, dropped)."""
    layout.scan()
    path = layout.path(stored[1])
    raw, before = path.read_bytes(), os.stat(path)
    edited = raw.replace(b'\\"num_tokens\\":10', b'\\"num_tokens\\":11', 1)
    assert len(edited) == len(raw) and edited != raw
    path.write_bytes(edited)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert layout.read(stored[1]) is None and not path.exists()


@pytest.mark.parametrize("block", [0, 1, -1], ids=["first", "full", "last-partial"])
def test_a_manifest_whose_block_sizes_disagree_with_its_tensors_is_corrupt(layout, stored,
                                                                            block):
    """A consistent hash does not make a manifest right: every block's size must be its
    header's plus its rows' (10 tokens in blocks of 4: two full blocks, one of 2 rows)."""
    from foretell_blockstore import manifest as mf

    fields = mf.parse(layout.path(stored[1]).read_bytes()).fields
    assert len(fields["groups"][0]["blocks"]) == 3
    assert mf._parse_fields(json.loads(json.dumps(fields))).groups  # as written: consistent
    edited = json.loads(json.dumps(fields))
    edited["groups"][0]["blocks"][block][1] += 2
    with pytest.raises(CorruptEntry, match="does not cover its tensors exactly"):
        mf._parse_fields(edited)


@pytest.mark.parametrize("cut", [3, 8, 40])
def test_a_truncated_manifest_is_never_served(layout, stored, cut):
    path = layout.path(stored[1])
    path.write_bytes(path.read_bytes()[:cut])
    assert layout.read(stored[1]) is None
    assert layout.scan() == []


def test_garbage_manifest_is_dropped_on_scan(layout, stored):
    (layout.entries_dir / ("f" * 32 + ".safetensors")).write_bytes(struct.pack("<Q", 2) + b"{}")
    assert [h.key for h in layout.scan()] == [stored[1]]


def test_a_renamed_manifest_does_not_answer_for_another_prompt(layout, stored, codecs):
    other_key = layout.key_for(range(3))
    os.rename(layout.path(stored[1]), layout.path(other_key))
    assert layout.read(other_key) is None


def test_an_entry_of_another_identity_is_never_served_and_kept(tmp_path, layout, stored, identity):
    foreign = BlockStoreLayout(tmp_path, layout.config,
                               identity=StoreIdentity(**{**_fields(identity), "tokenizer_hash": "zz"}))
    os.rename(layout.path(stored[1]), foreign.path(stored[1]))  # same directory
    assert foreign.read(stored[1]) is None
    assert foreign.path(stored[1]).exists()


@pytest.mark.parametrize("version", [b"blocks/1", b"blocks/2", b"blocks/9"],
                         ids=["crc32-era", "piece-stream-era", "future"])
def test_an_unknown_format_version_is_skipped_and_kept(layout, stored, version):
    path = layout.path(stored[1])
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"foretell.format_version":"blocks/4"',
                                 b'"foretell.format_version":"' + version + b'"', 1))
    assert layout.read(stored[1]) is None and layout.scan() == [] and path.exists()
    # Another version's manifest may list blocks this reader cannot see: keep them all.
    layout.collect()
    assert len(block_files(layout)) == 3


def _fields(identity: StoreIdentity) -> dict:
    return {"model_fingerprint": identity.model_fingerprint, "kv_scheme": identity.kv_scheme,
            "model_id": identity.model_id, "tokenizer_hash": identity.tokenizer_hash,
            "codec_providers": identity.codec_providers}


# -- a failing disk ---------------------------------------------------------------------------


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_failing_disk_warns_once_and_never_raises(layout, codecs, monkeypatch, caplog, err):
    def fail(*_a, **_k):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr("foretell_blockstore.blockfile.full_fsync", fail)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.write(entry_of(range(8), codecs)) is False
        assert layout.write(entry_of(range(9), codecs)) is False
    assert len(caplog.records) == 1 and layout.io_failures == 2
    assert not [p for p in layout.directory.rglob("*.tmp")] and not manifest_files(layout)


def test_a_failed_rewrite_leaves_the_previous_entry_servable(layout, codecs, monkeypatch):
    entry = entry_of(range(8), codecs)
    layout.write(entry)
    monkeypatch.setattr("foretell_blockstore.layout.os.replace",
                        lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "io")))
    assert layout.write(entry) is False
    monkeypatch.undo()
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
