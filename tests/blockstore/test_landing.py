"""Reads that land an entry whole (``foretell.platform.cuda.areas.LandingArea``): every
block's tensor bytes in one scratch, each staging slot one copy, then one pass places every
run into its tensor. On a CUDA GPU the area is device memory placed by a kernel; here a host
area placed by the CPU stands in (``blockfill.as_on_cuda``), so where each run goes is checked
against the bytes the writer stored, on every path a read takes: plain, quantized and ring
tensors, reserve buffers, damaged blocks, device digests, the area held by another read, an
entry over the cap, and a kernel that fails."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from blockfill import (
    as_on_cuda,
    assert_same_entry,
    entry_of,
    failing_staging,
    flip_a_byte,
    kv_of,
    listed_blocks,
    manifest_files,
    ring_of,
)

from foretell.cache.codecs import snapshot_entry
from foretell.cache.quantized import QuantizedKVCache
from foretell.platform import cuda, device
from foretell.platform.cuda.areas import LandingArea
from foretell.platform.cuda.driver import address
from foretell.store import digest
from foretell_blockstore import manifest as mf
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout


@pytest.fixture
def area(monkeypatch):
    """A host landing area, filled through host staging, into buffers made on the host:
    the reference path, the same on a CUDA host as anywhere."""
    found = LandingArea()
    as_on_cuda(monkeypatch, gpu_landing=False, landing=found)
    return found


def mixed_entry(codecs, tokens: int = 23):
    """Three groups of row counts: plain float32 KV, a wrapped ring, 4-bit quantized KV."""
    quantized = QuantizedKVCache(bits=4, group_size=32)
    keys = mx.random.normal((1, 2, tokens, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    quantized.update_and_fetch(keys, keys * 0.5)
    ring = ring_of(tokens, max_size=10)
    return snapshot_entry(range(tokens), [kv_of(range(tokens))[0], ring, quantized], codecs)


@pytest.mark.parametrize("from_reserve", [False, True])
def test_an_entry_lands_whole_and_reads_back_as_stored(layout, codecs, area, from_reserve):
    entry = mixed_entry(codecs)
    assert layout.write(entry)
    if from_reserve:
        layout.replenish()
        assert layout.reserve is not None and layout.reserve.held() > 0
    got = layout.read(layout.key_for(entry.tokens))
    assert_same_entry(got, entry)
    assert "placed" in layout.last_read_ms
    if from_reserve:
        assert layout.reserve.served == 1
    assert area.nbytes > 0


def test_the_plan_puts_each_run_where_the_piece_by_piece_read_puts_it(layout, codecs):
    """The runs' destinations, in order, are the slices :func:`mf.destinations` gives the
    piece-by-piece read, and each block's runs come from consecutive bytes of the area,
    starting at that block's offset."""
    entry = mixed_entry(codecs, tokens=29)
    assert layout.write(entry)
    manifest = layout._load_manifest(layout.key_for(entry.tokens))
    flats = {(s.layer, s.name): memoryview(bytearray(s.piece_bytes(0, s.rows)))
             for s in manifest.specs}
    offsets, need, runs = mf.landing_plan(
        manifest, {key: address(flat) for key, flat in flats.items()})
    expected, starts = [], []
    for group, refs in manifest.groups:
        for ref, (begin, end) in zip(refs, group.spans(manifest.block_rows)):
            starts.append(len(expected))
            at = offsets[len(starts) - 1]
            for piece in mf.destinations(group, begin, end, flats):
                for run in piece:
                    expected.append((at, address(run), run.nbytes))
                    at += run.nbytes
            assert at - offsets[len(starts) - 1] == ref.nbytes - len(
                mf.block_header(group, begin, end))
    assert [tuple(row) for row in runs.tolist()] == expected
    assert len(offsets) == len(manifest.blocks) and offsets == sorted(offsets)
    assert all(o % mf.LANDING_ALIGN == 0 for o in offsets) and need >= expected[-1][0]


@pytest.mark.parametrize("digests", ["off", "on"])
def test_a_flipped_byte_is_never_served_and_its_block_is_deleted(
        layout, codecs, area, caplog, monkeypatch, digests):
    monkeypatch.setattr(digest, "enabled", lambda: digests == "on")
    entry = digest.attach(entry_of(range(10), codecs))
    assert layout.write(entry)
    path = layout.block_path(listed_blocks(layout, entry)[1])
    flip_a_byte(path)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.read(layout.key_for(entry.tokens)) is None
    assert sum("dropped" in r.message for r in caplog.records) == 1
    assert not manifest_files(layout) and not path.exists()


def test_a_read_finding_the_area_held_lands_piece_by_piece(layout, codecs, area):
    entry = mixed_entry(codecs)
    assert layout.write(entry)
    assert area.acquire(1) is not None  # another restore's
    try:
        assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
        assert "placed" not in layout.last_read_ms
    finally:
        area.release()
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert "placed" in layout.last_read_ms


def test_an_entry_over_the_reserve_cap_lands_piece_by_piece(tmp_path, identity, codecs, area):
    layout = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4, restore_reserve_mb=0),
                              identity=identity)
    entry = mixed_entry(codecs)
    assert layout.write(entry)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert "placed" not in layout.last_read_ms and area.nbytes == 0


def test_a_failed_copy_to_the_area_fails_the_read_and_keeps_the_entry(
        layout, codecs, area, monkeypatch, caplog):
    """A driver call failing (not the files) is not the entry's fault: it is not served
    and not dropped; every reader waited for its copies before the area was let go."""
    failing, finished = failing_staging("send_to", "cuMemcpyHtoDAsync")
    monkeypatch.setattr(cuda.driver, "staging", failing)
    entry = mixed_entry(codecs)
    assert layout.write(entry)
    key = layout.key_for(entry.tokens)
    with caplog.at_level(logging.WARNING):
        assert layout.read(key) is None
    assert "cuMemcpyHtoDAsync failed" in caplog.text
    assert len(finished) == len(layout._load_manifest(key).blocks)
    assert area.acquire(1) is not None  # released
    area.release()
    monkeypatch.undo()
    assert_same_entry(layout.read(key), entry)


def test_a_failing_kernel_warns_once_and_reads_land_piece_by_piece(
        layout, codecs, area, caplog, monkeypatch):
    monkeypatch.setattr(cuda.areas, "_LANDING", [area])

    def refuse(runs):
        raise RuntimeError("nvrtc: no such compiler")

    monkeypatch.setattr(area, "place", refuse)
    entry = mixed_entry(codecs)
    assert layout.write(entry)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert "placed" not in layout.last_read_ms
    assert [r.message for r in caplog.records if "piece by piece" in r.message] != []
    assert cuda.areas._LANDING == [None]


def test_an_empty_store_readies_no_landing_until_it_holds_an_entry(layout, codecs, area,
                                                                 monkeypatch):
    prepared = []
    monkeypatch.setattr(area, "prepare", prepared.append)
    layout.replenish()  # as a tier opens on a fresh directory: nothing to restore yet
    assert prepared == []
    assert layout.write(mixed_entry(codecs))
    layout.replenish()  # as the request that stored it ends
    assert len(prepared) == 1 and prepared[0] > 0


def test_replenish_readies_the_area_for_the_largest_entry_so_a_read_does_not_grow_it(
        layout, codecs, area, monkeypatch):
    entry = mixed_entry(codecs)
    assert layout.write(entry)
    layout.replenish()
    manifest = layout._load_manifest(layout.key_for(entry.tokens))
    flats = {(s.layer, s.name): memoryview(bytearray(s.piece_bytes(0, s.rows)))
             for s in manifest.specs}
    _offsets, need, _runs = mf.landing_plan(
        manifest, {key: address(flat) for key, flat in flats.items()})
    assert area.nbytes >= mf.landing_bytes(manifest.blocks) >= need > 0
    grown = []
    monkeypatch.setattr(area, "_allocate", lambda n: grown.append(n))
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert "placed" in layout.last_read_ms and grown == []


def test_the_area_grows_in_grains_and_is_held_by_one_read_at_a_time():
    found = LandingArea()
    base = found.acquire(10)
    assert base and found.nbytes == LandingArea.GRAIN
    assert found.acquire(10) is None  # held
    found.release()
    assert found.acquire(LandingArea.GRAIN) == base  # fits: not reallocated
    found.release()
    found.reserve(LandingArea.GRAIN + 1)
    assert found.nbytes == 2 * LandingArea.GRAIN


def gpu_landing() -> bool:
    """Whether reads here land on a CUDA GPU (the GPU-only tests run there)."""
    backend = device.cuda_backend()
    return backend is not None and backend.driver.gpu_landing()


@pytest.mark.skipif(not gpu_landing(), reason="needs MLX on a CUDA GPU")
def test_the_device_kernel_places_runs_of_every_alignment():
    """The CUDA kernel copies 16 bytes, 4 bytes or 1 byte a thread as each run allows; every
    byte lands where the host reference puts it, and none around it changes."""
    rng = np.random.default_rng(5)
    source = rng.integers(0, 256, size=1 << 20, dtype=np.uint8)
    found = cuda.areas.landing()
    base = found.acquire(source.nbytes)
    try:
        stage = cuda.driver.staging()
        slot = stage.slot(source.nbytes)
        slot[:] = source.tobytes()
        stage.send_to(slot, base)
        stage.finish()
        target = mx.zeros((1 << 20,), dtype=mx.uint8, stream=mx.gpu)
        mx.eval(target)
        flat = memoryview(target).cast("B")
        to = address(flat)
        runs = np.array([[0, to, 4096], [4096 + 4, to + 8192 + 4, 1000],
                         [9001, to + 20001, 777], [65536, to + 131072, 262144]], dtype=np.uint64)
        found.place(runs)
    finally:
        found.release()
    want = np.zeros(1 << 20, dtype=np.uint8)
    for offset, dest, n in runs.tolist():
        want[dest - to:dest - to + n] = source[offset:offset + n]
    assert np.array_equal(np.asarray(target), want)
