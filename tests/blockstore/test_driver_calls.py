"""The block store's paths on a CUDA GPU, run through a stand-in driver (``fake_cuda``) that
copies in host memory as the real one copies to and from the GPU: every struct field,
pitch, offset and allocation ``foretell.platform.cuda`` hands the driver must put the bytes
where the host path puts them. Only the placing kernel is not the driver's: a host loop
over the same table stands in for it (the kernel itself is tested on the H200)."""

from __future__ import annotations

import ctypes

import pytest
from blockfill import as_on_cuda, assert_same_entry, block_files, listed_blocks, per_thread
from fake_cuda import fake_driver
from test_landing import mixed_entry

from foretell.platform.cuda import areas
from foretell.platform.cuda.areas import DeviceLandingArea, HostArea, PinnedArea
from foretell.platform.cuda.driver import CudaStaging
from foretell_blockstore import manifest as mf
from foretell_blockstore.layout import BlockStoreLayout


@pytest.fixture
def driver(monkeypatch):
    """The fake driver behind per-thread CUDA staging, reads landing on the "GPU" into
    buffers made on the host, no landing or write area unless a test adds one."""
    found, host_buffers = fake_driver(), mf.host_buffers
    as_on_cuda(monkeypatch, staging=per_thread(lambda: CudaStaging(found)))
    monkeypatch.setattr(mf, "host_buffers",
                        lambda specs, on_gpu, reserve=None: host_buffers(specs))
    return found


def host_placing(table) -> None:
    for source, to, nbytes in table.tolist():
        ctypes.memmove(to, source, nbytes)


def test_a_read_piece_by_piece_through_the_driver_serves_what_was_written(layout, codecs,
                                                                        driver):
    """The path the H200 has run since 2026-12-01: it checks the stand-in as much as the
    code (strided 2-D copies of each piece's runs)."""
    entry = mixed_entry(codecs, tokens=29)
    assert layout.write(entry)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert "cuMemcpy2DAsync" in driver.lib.calls and "placed" not in layout.last_read_ms


def test_a_read_landing_whole_through_the_driver_serves_what_was_written(
        layout, codecs, driver, monkeypatch):
    area = DeviceLandingArea(driver)
    monkeypatch.setattr(area, "_launch", host_placing)
    monkeypatch.setattr(areas, "landing", lambda: area)
    entry = mixed_entry(codecs, tokens=29)
    assert layout.write(entry)
    driver.lib.calls.clear()
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert "placed" in layout.last_read_ms
    assert "cuMemAlloc" in driver.lib.calls and "cuMemcpy2DAsync" not in driver.lib.calls
    blocks = len(layout._load_manifest(layout.key_for(entry.tokens)).blocks)
    assert driver.lib.calls.count("cuMemcpyHtoDAsync") >= blocks  # a slot is one copy


def test_a_write_gathered_through_the_driver_stores_the_host_paths_blocks(
        tmp_path, identity, layout, codecs, driver, monkeypatch):
    area = PinnedArea(driver)
    monkeypatch.setattr(areas, "write_area", lambda: area)
    entry = mixed_entry(codecs, tokens=29)
    assert layout.write(entry)
    assert {"cuMemHostAlloc", "cuMemcpy2DAsync"} <= set(driver.lib.calls)
    monkeypatch.setattr(areas, "write_area", lambda: None)
    host = BlockStoreLayout(tmp_path / "host", layout.config, identity=identity)
    assert host.write(entry)
    assert listed_blocks(layout, entry) == listed_blocks(host, entry)
    for block_id in block_files(layout):
        assert layout.block_path(block_id).read_bytes() == host.block_path(block_id).read_bytes()
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)


@pytest.mark.parametrize("kind", ["device", "pinned"])
def test_an_area_that_grows_frees_what_it_held(driver, kind):
    area = DeviceLandingArea(driver) if kind == "device" else PinnedArea(driver)
    area.reserve(10)
    area.reserve(HostArea.GRAIN + 1)  # the fake refuses to free what it never gave
    assert area.nbytes == 2 * HostArea.GRAIN
    freed = "cuMemFree" if kind == "device" else "cuMemFreeHost"
    assert driver.lib.calls.count(freed) == 1
