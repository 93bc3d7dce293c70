"""The restore reserve: a block-store read takes its buffers from slabs filled before the
restore (when they hold enough), restores the same bytes and tokens as from fresh buffers,
falls back when too small or off, never hands one byte to two restores, refills at the
tier's opening and after a request, survives ``mx.clear_cache()``, refuses bad caps by name,
and never lets a damaged entry through."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from blockfill import as_on_cuda, assert_same_entry, entry_of

import foretell
from foretell.cache.tier import CacheTier
from foretell.errors import ConfigError
from foretell.store import BufferReserve, KeepsRestoreReserve
from foretell.store import reserve as rsv
from foretell.tools import make_model_dir
from foretell_blockstore import manifest as mf
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout


def address_range(array: mx.array) -> tuple[int, int]:
    """``[start, end)`` of the bytes an evaluated array's buffer protocol exposes."""
    host = np.asarray(memoryview(array.view(mx.uint8)))  # a view: the same bytes
    start = host.__array_interface__["data"][0]
    return start, start + host.nbytes


def tensor_ranges(entry) -> list[tuple[int, int]]:
    return [address_range(t) for layer in entry.layers for t in layer.tensors.values()]


def inside(ranges, outer) -> bool:
    return all(outer[0] <= a and b <= outer[1] for a, b in ranges)


def overlap(first, second) -> bool:
    return any(a < d and c < b for a, b in first for c, d in second)


def opened(tmp_path, identity, mb=None, **options):
    return BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4, restore_reserve_mb=mb,
                                                       **options), identity=identity)


@pytest.fixture
def stored(tmp_path, identity, codecs):
    """A layout with a reserve big enough for anything here, and one entry written."""
    layout = opened(tmp_path, identity, mb=8)
    entry = entry_of(range(30), codecs, layers=3, dtype=mx.bfloat16)
    assert layout.write(entry)
    return layout, entry, layout.key_for(entry.tokens)


def slab_range(layout) -> tuple[int, int]:
    (slab,) = layout.reserve._slabs
    return address_range(slab)


def test_the_block_store_keeps_a_restore_reserve():
    assert issubclass(BlockStoreLayout, KeepsRestoreReserve)


def test_a_read_takes_its_buffers_from_the_reserve_and_restores_the_same_bytes(stored):
    layout, entry, key = stored
    fresh = layout.read(key)  # nothing filled yet: fresh buffers
    layout.replenish()
    slab = slab_range(layout)
    held = layout.reserve.held()
    assert held >= mf.buffer_bytes(mf.plan_groups(entry))
    from_reserve = layout.read(key)
    assert layout.reserve.served == 1
    assert inside(tensor_ranges(from_reserve), slab)  # the read wrote into the slab itself
    assert not inside(tensor_ranges(fresh), slab)
    assert_same_entry(from_reserve, entry)
    assert_same_entry(fresh, entry)
    assert layout.reserve.held() == 0 or layout.reserve.held() < held


def test_two_restores_never_share_memory_and_the_second_falls_back(stored):
    layout, entry, key = stored
    layout.replenish()
    first = layout.read(key)
    second = layout.read(key)  # the reserve's rest is too small for a whole entry
    assert (layout.reserve.served, layout.reserve.missed) == (1, 1)
    assert not overlap(tensor_ranges(first), tensor_ranges(second))
    assert_same_entry(first, entry)
    assert_same_entry(second, entry)


def test_a_slabs_rest_serves_a_later_smaller_restore_on_other_bytes(tmp_path, identity, codecs):
    layout = opened(tmp_path, identity, mb=8)
    small, large = entry_of(range(9), codecs), entry_of(range(100, 160), codecs)
    assert layout.write(small) and layout.write(large)
    layout.replenish()  # sized to the larger entry: the small one fits in its rest
    (slab,) = layout.reserve._slabs
    assert slab.size >= mf.buffer_bytes(mf.plan_groups(large))
    first = layout.read(layout.key_for(small.tokens))
    second = layout.read(layout.key_for(small.tokens))
    assert layout.reserve.served == 2
    whole = address_range(slab)
    assert inside(tensor_ranges(first), whole) and inside(tensor_ranges(second), whole)
    assert not overlap(tensor_ranges(first), tensor_ranges(second))
    assert_same_entry(first, small)
    assert_same_entry(second, small)


def test_writing_into_a_restored_cache_never_reaches_the_reserve_or_another_restore(stored):
    layout, entry, key = stored
    layout.replenish()
    first = layout.read(key)
    rest = [np.asarray(s).copy() for s in layout.reserve._slabs]
    for layer in first.layers:
        for name in layer.tensors:
            layer.tensors[name] = layer.tensors[name] + 1  # what a decode step makes
    mx.eval([t for layer in first.layers for t in layer.tensors.values()])
    assert all(np.array_equal(np.asarray(s), r) for s, r in zip(layout.reserve._slabs, rest))
    assert all(not r.any() for r in rest)  # the rest is still untouched zeros


def test_a_reserve_too_small_or_off_falls_back_to_fresh_buffers(tmp_path, identity, codecs,
                                                               monkeypatch):
    entry = entry_of(range(30), codecs, layers=3)
    need = mf.buffer_bytes(mf.plan_groups(entry))
    small = opened(tmp_path / "small", identity, mb=(need // 2) / rsv.MiB)
    assert small.write(entry)
    small.replenish()
    assert 0 < small.reserve.held() < need
    assert_same_entry(small.read(small.key_for(entry.tokens)), entry)
    assert (small.reserve.served, small.reserve.missed) == (0, 1)

    off = opened(tmp_path / "off", identity, mb=0)
    assert off.write(entry)
    off.replenish()
    assert off.reserve is None
    assert_same_entry(off.read(off.key_for(entry.tokens)), entry)

    monkeypatch.setenv(rsv.ENV, "0")
    by_env = opened(tmp_path / "env", identity)
    assert by_env.write(entry)
    by_env.replenish()
    assert by_env.reserve is None


def test_replenish_refills_once_a_restore_used_the_reserve(stored):
    layout, _entry, key = stored
    layout.replenish()
    layout.replenish()  # holds enough: no second fill
    assert layout.reserve.fills == 1
    layout.read(key)
    layout.replenish()
    assert layout.reserve.fills == 2
    assert layout.reserve.held() >= layout._indexed()[0].buffer_bytes
    assert layout.reserve.held() <= layout.reserve.max_bytes


def test_a_larger_entry_stored_alone_does_not_refill_at_each_request_end(tmp_path, identity,
                                                                         codecs):
    # A conversation stores a longer entry every turn, mostly served from RAM: refilling
    # to each new largest size would zero-fill a slab after every request.
    layout = opened(tmp_path, identity, mb=8)
    assert layout.write(entry_of(range(9), codecs))
    layout.replenish()
    held = layout.reserve.held()
    larger = entry_of(range(100, 160), codecs)
    assert layout.write(larger)
    layout.replenish()
    assert layout.reserve.fills == 1 and layout.reserve.held() == held
    layout.read(layout.key_for(range(9)))  # a restore takes from it: now it refills, larger
    layout.replenish()
    assert layout.reserve.fills == 2
    assert layout.reserve.held() >= mf.buffer_bytes(mf.plan_groups(larger))


def test_the_reserve_holds_live_arrays_that_clear_cache_does_not_free(stored):
    layout, entry, key = stored
    layout.replenish()
    held = layout.reserve.held()
    mx.eval(mx.zeros((1 << 20,)))
    mx.clear_cache()  # the decode loops call it every 256 steps
    assert mx.get_cache_memory() == 0
    assert mx.get_active_memory() >= held
    assert_same_entry(layout.read(key), entry)
    assert layout.reserve.served == 1


def test_a_damaged_entry_read_into_reserve_buffers_is_not_served(stored, caplog):
    layout, _entry, key = stored
    layout.replenish()
    block = layout.block_path(layout._load_manifest(key).blocks[1].id)
    raw = bytearray(block.read_bytes())
    raw[-3] ^= 0xFF
    block.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        assert layout.read(key) is None
    assert layout.reserve.served == 1  # it did read into the reserve's buffers
    assert "fails its checksum" in caplog.text
    assert not layout.path(key).exists()  # dropped, as from fresh buffers


@pytest.mark.parametrize("value", ["lots", "-1", "nan", "inf"])
def test_a_bad_reserve_env_var_is_an_error_naming_it(tmp_path, identity, monkeypatch, value):
    monkeypatch.setenv(rsv.ENV, value)
    with pytest.raises(ConfigError, match=rsv.ENV):
        opened(tmp_path, identity)


def test_the_cache_table_sets_the_reserve_and_a_bad_value_names_its_key(tmp_path):
    from foretell import config
    from foretell.plugin.loader import load_plugins

    registry = load_plugins().registry
    path = tmp_path / "run.toml"
    path.write_text("[cache]\nrestore_reserve_mb = 256\n")
    assert config.load_run_config(registry, path).cache.layout_options == BlockStoreConfig(
        restore_reserve_mb=256)
    path.write_text("[cache]\nrestore_reserve_mb = -1\n")
    with pytest.raises(ConfigError, match="cache.restore_reserve_mb: must be a number >= 0"):
        config.load_run_config(registry, path)


def test_the_cap_bounds_what_the_reserve_holds():
    reserve = BufferReserve(4096)
    assert reserve.refill(1 << 20) > 0
    assert reserve.held() == 4096
    assert reserve.take([4000]) is not None
    assert reserve.take([100]) is None and reserve.held() == 0
    reserve.refill(1 << 20)
    reserve.refill(1 << 20)
    assert reserve.fills == 2 and reserve.held() == 4096
    assert BufferReserve(0).refill(1 << 20) == 0.0


def test_on_a_cuda_landing_the_reserve_is_born_on_the_gpu(stored, monkeypatch):
    """Where reads land on the GPU by DMA, the slab's managed memory must be born there (as
    host_buffers' own fills are): the layout's reserve fills on the GPU stream."""
    layout, _entry, _key = stored
    streams, zeros = [], mx.zeros

    def recording_zeros(shape, dtype, stream):
        streams.append(stream)
        return zeros(shape, dtype=dtype, stream=mx.cpu)  # this host has no GPU

    as_on_cuda(monkeypatch)
    monkeypatch.setattr(mx, "zeros", recording_zeros)
    layout.replenish()
    assert layout.reserve.on_gpu and streams == [mx.gpu]


def test_a_staged_read_copies_into_the_reserves_buffers(stored, monkeypatch):
    """The GPU path (each piece read into a staging slot, hashed, copied into its runs)
    lands in the carved views too; here the host staging stands in for the DMA."""
    layout, entry, key = stored
    layout.replenish()
    slab = slab_range(layout)

    as_on_cuda(monkeypatch)  # piece by piece (landing whole: test_landing.py)
    restored = layout.read(key)
    assert layout.reserve.served == 1 and inside(tensor_ranges(restored), slab)
    assert_same_entry(restored, entry)


def test_a_refill_replaces_the_rests_earlier_restores_left():
    reserve = BufferReserve(1 << 20)
    reserve.refill(8192)
    assert reserve.take([1000]) is not None and reserve.held() == 8192 - 1024
    reserve.refill(8192)  # the rest is too small for the largest entry: one new slab
    assert reserve.fills == 2 and reserve.held() == 8192 and len(reserve._slabs) == 1


def test_a_restore_never_waits_for_a_fill_in_progress(monkeypatch):
    import threading

    started, release, zeros = threading.Event(), threading.Event(), mx.zeros

    def slow_zeros(*args, **kwargs):
        started.set()
        release.wait(10)
        return zeros(*args, **kwargs)

    reserve = BufferReserve(1 << 20)
    monkeypatch.setattr(mx, "zeros", slow_zeros)
    filler = threading.Thread(target=reserve.refill, args=(4096,))
    filler.start()
    assert started.wait(10)
    assert reserve.take([100]) is None  # at once: the fill is still held up
    assert reserve.refill(4096) == 0.0  # and a second refill does not start another
    release.set()
    filler.join(10)
    assert reserve.take([100]) is not None and reserve.fills == 1


# -- through the engine --------------------------------------------------------------------

PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3")


def run(engine, prompt=PROMPT):
    events = list(engine.generate(prompt, max_tokens=8, ignore_eos=True))
    return [t for e in events[:-1] for t in e.tokens], events[-1]


@pytest.mark.parametrize("reserve_mb", [None, "0"], ids=["reserve", "off"])
def test_a_restore_from_the_reserve_continues_token_identically(model_dir, tmp_path,
                                                                monkeypatch, reserve_mb):
    if reserve_mb is not None:
        monkeypatch.setenv(rsv.ENV, reserve_mb)
    original, _ = run(foretell.load(model_dir))
    writer = foretell.load(model_dir)
    writer.cache = CacheTier.for_engine(writer, tmp_path, layout="blocks")
    run(writer)
    assert writer.cache.close(10).durable

    engine = foretell.load(model_dir)
    engine.cache = CacheTier.for_engine(engine, tmp_path, layout="blocks")
    layout = engine.cache.ssd.layout
    if reserve_mb is None:  # the tier's opening filled it
        assert layout.reserve.fills == 1 and layout.reserve.held() > 0
    restored, stats = run(engine)
    assert stats.cached_from == "ssd" and restored == original
    if reserve_mb is None:
        assert layout.reserve.served == 1
        assert layout.reserve.fills == 2  # refilled at the request's end
    else:
        assert layout.reserve is None
