"""Writes that gather an entry's pieces by DMA (a CUDA GPU): each block's pieces copied from
the tensors into a page-locked area, then named, hashed and written from there, instead of
the CPU reading the tensors' managed memory (which moves their pages off the GPU). Here a
host area filled by host copies stands in (``blockfill.as_on_cuda``): the blocks it writes
must be the very blocks the host path writes, byte for byte, on every path a write takes."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from blockfill import as_on_cuda, assert_same_entry, block_files, listed_blocks, per_thread
from test_landing import gpu_landing, mixed_entry

from foretell.platform import device
from foretell.platform.cuda import areas, driver
from foretell_blockstore import blockfile
from foretell_blockstore.layout import BlockStoreLayout


@pytest.fixture
def area(monkeypatch):
    """A host write area and host staging that count the pieces they gather."""
    found, fetched = areas.HostArea(), []

    class Counting(driver.Staging):
        def fetch(self, into, first, width, count, pitch):
            fetched.append(into.nbytes)
            super().fetch(into, first, width, count, pitch)

    # Reads on the host too: host staging copying into a GPU's landing area (device
    # memory) would write where the CPU cannot.
    as_on_cuda(monkeypatch, gpu_landing=False, staging=per_thread(Counting), write_area=found)
    found.fetched = fetched
    return found


def same_blocks(layout, other, entry) -> None:
    assert listed_blocks(layout, entry) == listed_blocks(other, entry)
    for block_id in block_files(layout):
        assert layout.block_path(block_id).read_bytes() == other.block_path(block_id).read_bytes()


def test_a_gathered_write_stores_the_blocks_the_host_path_stores(
        tmp_path, identity, codecs, layout, area, monkeypatch):
    entry = mixed_entry(codecs, tokens=29)
    # A cache's snapshot is a token slice of a larger buffer: heads lie apart, not end to end.
    assert not all(memoryview(a).c_contiguous for la in entry.layers for a in la.tensors.values())
    assert layout.write(entry)
    tensor_bytes = sum(a.nbytes for la in entry.layers for a in la.tensors.values())
    assert sum(area.fetched) == tensor_bytes  # every byte came through the area
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    monkeypatch.setattr(areas, "write_area", lambda: None)
    host = BlockStoreLayout(tmp_path / "host", layout.config, identity=identity)
    assert host.write(entry)
    same_blocks(layout, host, entry)


def test_a_write_finding_the_area_held_reads_the_tensors_on_the_host(
        tmp_path, identity, codecs, layout, area):
    entry = mixed_entry(codecs)
    assert area.acquire(1) is not None  # another write's
    try:
        assert layout.write(entry)
    finally:
        area.release()
    assert area.fetched == []
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)


def test_an_entry_over_the_reserve_cap_or_without_room_is_read_on_the_host(
        tmp_path, identity, codecs, area, monkeypatch):
    from foretell_blockstore.layout import BlockStoreConfig

    capped = BlockStoreLayout(tmp_path / "capped", BlockStoreConfig(block_tokens=4,
                                                                    restore_reserve_mb=0),
                              identity=identity)
    entry = mixed_entry(codecs)
    assert capped.write(entry) and area.fetched == [] and area.nbytes == 0

    def no_room(nbytes):
        raise driver.CudaCopyError("CUDA driver call cuMemHostAlloc failed (CUresult 2)")

    monkeypatch.setattr(area, "_allocate", no_room)
    roomless = BlockStoreLayout(tmp_path / "roomless", BlockStoreConfig(block_tokens=4),
                                identity=identity)
    assert roomless.write(entry) and area.fetched == []
    assert_same_entry(roomless.read(roomless.key_for(entry.tokens)), entry)
    assert area.acquire(0) is not None  # not left held
    area.release()


def test_a_strided_tensor_makes_the_write_read_on_the_host(tmp_path, identity, codecs,
                                                          layout, area, monkeypatch):
    entry = mixed_entry(codecs)
    strided = attrs.evolve(entry, layers=[
        attrs.evolve(la, tensors={n: mx.contiguous(mx.swapaxes(a, -1, -2)).swapaxes(-1, -2)
                                  if a.ndim == 4 else a for n, a in la.tensors.items()})
        for la in entry.layers])
    assert layout.write(strided)
    assert area.fetched == []
    monkeypatch.setattr(areas, "write_area", lambda: None)
    host = BlockStoreLayout(tmp_path / "host", layout.config, identity=identity)
    assert host.write(entry)
    same_blocks(layout, host, entry)


def test_run_layout_finds_the_runs_of_a_slice_and_refuses_a_transpose():
    from foretell_blockstore import manifest as mf

    buffer = np.zeros((2, 4, 16, 8), dtype=np.float32)
    address = buffer.__array_interface__["data"][0]
    assert mf.run_layout(buffer) == (address, 16 * 8 * 4)
    assert mf.run_layout(buffer[:, :, 3:10]) == (address + 3 * 32, 16 * 8 * 4)
    assert mf.run_layout(buffer[:1, 1:2]) == (address + 16 * 8 * 4, 16 * 8 * 4)
    assert mf.run_layout(buffer.swapaxes(-1, -2)) is None
    assert mf.run_layout(buffer[:, ::2]) == (address, 2 * 16 * 8 * 4)
    assert mf.run_layout(buffer[:, :3]) is None  # batches and heads at no one pitch
    assert mf.run_layout(buffer[:, :, :, :4]) is None  # a row is not one run


def test_the_area_is_released_when_a_block_fails_to_write(codecs, layout, area, monkeypatch):
    def full(path, *chunks):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(blockfile, "write_durably", full)
    assert layout.write(mixed_entry(codecs)) is False
    assert area.acquire(1) is not None
    area.release()


def test_writes_gather_by_dma_wherever_reads_land_on_a_cuda_gpu(monkeypatch):
    """No switch: the write area exists exactly where the driver answers (a CUDA GPU), and
    the layout asks for it only through the seam, which answers nothing elsewhere."""
    monkeypatch.setattr(driver, "loaded", lambda: None)
    assert areas.write_area() is None
    monkeypatch.setattr(areas, "_WRITE_AREA", [])
    monkeypatch.setattr(driver, "loaded", lambda: "a driver")
    monkeypatch.setattr(areas, "PinnedArea", lambda found: ("pinned", found))
    assert areas.write_area() == ("pinned", "a driver") == areas.write_area()  # one a process
    assert (device.cuda_backend() is None) == (not device.on_cuda())


@pytest.mark.skipif(not gpu_landing(), reason="needs MLX on a CUDA GPU")
def test_the_device_fetch_gathers_strided_runs():
    found = areas.write_area()
    tensor = mx.arange(4 * 64 * 32, dtype=mx.uint32).reshape(1, 4, 64, 32)
    mx.eval(tensor)
    flat = memoryview(tensor).cast("B")
    base = found.acquire(4 * 16 * 32 * 4)
    try:
        stage = driver.staging()
        into = found.view(0, 4 * 16 * 32 * 4)
        # rows 8..24 of each of the 4 heads: 16 rows of 128 bytes, heads 64 rows apart
        stage.fetch(into, driver.address(flat) + 8 * 128, 16 * 128, 4, 64 * 128)
        stage.finish()
        got = np.frombuffer(into, dtype=np.uint32).reshape(1, 4, 16, 32)
    finally:
        found.release()
    assert base and np.array_equal(got, np.arange(4 * 64 * 32, dtype=np.uint32)
                                   .reshape(1, 4, 64, 32)[:, :, 8:24, :])
