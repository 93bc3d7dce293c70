"""The cache tier: RAM first, the SSD tier when it serves strictly more, restores promoted
into RAM, write-behind through a byte-capped spill queue, a byte-capped SSD tier with the
same supersession rules, and a flush that says "durable" only when it is true."""

from __future__ import annotations

import errno
import logging
import os
import threading

import numpy as np
import pytest
from cachefill import filled_kv, filled_rotating

from foretell.cache.tier import CacheTier
from foretell.store.single_file import SingleFileLayout


def host(a):
    return np.asarray(a)


@pytest.fixture
def layout(tmp_path, identity):
    return SingleFileLayout(tmp_path, identity=identity)


def tier_over(layout, codecs, **caps):
    fresh = SingleFileLayout(layout.directory.parent, identity=layout.identity)
    return CacheTier(codecs, layout=fresh, **caps)


def stored_tier(layout, codecs, tokens, caches, **caps):
    tier = tier_over(layout, codecs, **caps)
    tier.store(tokens, caches)
    assert tier.flush(10).durable
    return tier


def test_a_fresh_process_restores_from_disk_what_an_earlier_one_stored(layout, codecs):
    caches = [filled_kv(20), filled_rotating(12, max_size=16)]
    first = stored_tier(layout, codecs, range(12), [filled_kv(12), caches[1]])
    first.close()
    reuse = tier_over(layout, codecs).lookup([*range(12), 5])
    assert (reuse.tokens, reuse.tier) == (12, "ssd")
    np.testing.assert_array_equal(host(reuse.caches[1].state[0]), host(caches[1].state[0]))


def test_a_restored_entry_is_promoted_into_ram(layout, codecs):
    stored_tier(layout, codecs, range(12), [filled_kv(12)]).close()
    tier = tier_over(layout, codecs)
    assert tier.lookup([*range(12), 5]).tier == "ssd"
    assert tier.lookup([*range(12), 6]).tier == "ram"


def test_the_ssd_tier_is_read_only_when_it_serves_strictly_more(layout, codecs):
    stored_tier(layout, codecs, range(12), [filled_kv(12)]).close()
    tier = tier_over(layout, codecs)
    tier.ram.put(range(12), [filled_kv(12)])
    assert tier.lookup([*range(12), 5]).tier == "ram"
    assert tier.ssd.restores == 0


def test_restart_0_on_disk_an_untrimmable_longer_entry_keeps_the_prompt_snapshot(layout, codecs):
    tier = tier_over(layout, codecs)
    tier.store(range(12), [filled_kv(12), filled_rotating(12, max_size=16)])
    tier.store([*range(12), *range(100, 108)], [filled_kv(20), filled_rotating(20, max_size=16)])
    assert tier.flush(10).durable
    tier.close()
    fresh = tier_over(layout, codecs)
    assert len(fresh.ssd.entries()) == 2
    reuse = fresh.lookup([*range(12), 100, 555])
    assert (reuse.tokens, reuse.tier) == (12, "ssd")


def test_on_disk_a_trimmable_longer_entry_supersedes_its_ancestor(layout, codecs):
    tier = tier_over(layout, codecs)
    tier.store(range(8), [filled_kv(8)])
    tier.store(range(16), [filled_kv(16)])
    assert tier.flush(10).durable
    assert [s.tokens for s in tier.ssd.entries()] == [tuple(range(16))]


def test_the_ssd_cap_evicts_least_recently_used_by_bytes(layout, codecs):
    probe = stored_tier(layout, codecs, range(500, 516), [filled_kv(16)])
    unit = probe.ssd.bytes()
    probe.ssd.remove(probe.ssd.entries()[0].header.key)
    tier = tier_over(layout, codecs, ssd_bytes=2 * unit + unit // 2)
    for i in range(4):
        tier.store(range(100 * i, 100 * i + 16), [filled_kv(16)])
        tier.flush(10)
        assert tier.ssd.bytes() <= tier.ssd.max_bytes
    assert [s.tokens[0] for s in tier.ssd.entries()] == [200, 300]


def test_a_corrupt_file_is_never_served_and_the_next_best_entry_is(layout, codecs, caplog):
    tier = tier_over(layout, codecs)
    tier.store(range(8), [filled_kv(8), filled_rotating(8, max_size=8)])
    tier.store(range(16), [filled_kv(16), filled_rotating(16, max_size=8)])  # wrapped: both kept
    assert tier.flush(10).durable
    tier.close()
    longest = max(tier.ssd.entries(), key=lambda s: len(s.tokens))
    path = layout.path(longest.header.key)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40
    path.write_bytes(bytes(raw))
    fresh = tier_over(layout, codecs)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        reuse = fresh.lookup([*range(16), 1])
    assert (reuse.tokens, reuse.tier) == (8, "ssd")  # the damaged longer entry is skipped
    assert not path.exists() and sum("corrupt" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("failing", ["layout", "codec"])
def test_a_plugin_failing_to_restore_an_entry_costs_a_warning_not_the_request(
        layout, codecs, monkeypatch, caplog, failing):
    """A storage layout raising from ``read`` or a codec raising from ``load`` (defects of
    a plugin) makes the lookup a miss with one warning; it never raises into generation."""
    tier = stored_tier(layout, codecs, range(16), [filled_kv(16)])
    tier.close()
    fresh = tier_over(layout, codecs)

    def broken(*_args, **_kwargs):
        raise ValueError("a plugin's defect")

    if failing == "layout":
        monkeypatch.setattr(fresh.ssd.layout, "read", broken)
    else:
        monkeypatch.setattr(type(codecs[0]), "load", broken)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert fresh.lookup([*range(16), 1]).tier is None
    assert sum("a plugin's defect" in r.message for r in caplog.records) == 1
    assert layout.path(layout.key_for(range(16))).exists()


def test_an_entry_evicted_while_it_was_read_is_not_indexed_again(layout, codecs):
    """A restore on the request thread reading an entry the spill worker evicts meanwhile
    must not put it back in the index: a phantom would claim a state is on disk."""
    tier = stored_tier(layout, codecs, range(16), [filled_kv(16)])
    tier.ram.clear()
    key = layout.key_for(range(16))
    real = tier.ssd.layout.read

    def read_while_evicted(k):
        entry = real(k)
        tier.ssd.remove(k)  # what an eviction on the spill thread does, at this moment
        return entry

    tier.ssd.layout.read = read_while_evicted
    assert tier.lookup([*range(16), 1]).tier == "ssd"  # the bytes read were verified
    assert not tier.ssd.covers(range(16), "") and key not in {
        s.header.key for s in tier.ssd.entries()}


def test_a_write_whose_name_is_not_durable_is_not_counted_and_supersedes_nothing(
        layout, codecs, monkeypatch):
    """The file renamed in, its directory's fsync failing: the layout says not durable, so
    the tier neither claims it (flush) nor lets it replace the ancestor it could serve."""
    tier = stored_tier(layout, codecs, range(8), [filled_kv(8)])
    monkeypatch.setattr(type(layout), "_fsync_directory", lambda self: False)
    tier.store(range(16), [filled_kv(16)])  # would supersede the 8-token entry
    report = tier.flush(10)
    assert not report.durable and report.failed >= 1
    assert layout.path(layout.key_for(range(8))).exists()
    assert tier.ssd.covers(range(8), "") and not tier.ssd.covers(range(16), "")


def test_a_re_read_of_the_directory_keeps_a_removal_made_while_it_ran(layout, codecs,
                                                                      monkeypatch):
    """The spill thread re-reads the directory while the request thread deletes a finished
    generation's checkpoint: the removed entry must not come back with the re-read."""
    tier = stored_tier(layout, codecs, range(16), [filled_kv(16)])
    tier.store(range(100, 108), [filled_kv(8)])
    assert tier.flush(10).durable
    gone = layout.key_for(range(100, 108))
    real = tier.ssd.layout.scan

    def scan_then_removed_elsewhere():
        headers = real()
        tier.ssd.remove(gone)
        return headers

    monkeypatch.setattr(tier.ssd.layout, "scan", scan_then_removed_elsewhere)
    tier.ssd.scan()
    assert gone not in {s.header.key for s in tier.ssd.entries()}
    assert not tier.ssd.covers(range(100, 108), "")


def test_a_ram_hit_during_a_re_read_does_not_bring_back_an_entry_deleted_on_disk(
        layout, codecs, monkeypatch):
    """Another process evicted the file; a RAM hit marks its stored copy used while this
    process re-reads the directory: the re-read's result (gone) stands."""
    tier = stored_tier(layout, codecs, range(16), [filled_kv(16)])
    os.unlink(layout.path(layout.key_for(range(16))))
    real = tier.ssd.layout.scan

    def scan_then_a_ram_hit():
        headers = real()
        tier.ssd.touch(range(16), "")
        return headers

    monkeypatch.setattr(tier.ssd.layout, "scan", scan_then_a_ram_hit)
    tier.ssd.scan()
    assert not tier.ssd.covers(range(16), "") and tier.ssd.find_exact(range(16), "") is None


def test_a_checkpoint_dropped_before_its_generation_completed_does_not_doom_a_rerun(
        layout, codecs, monkeypatch):
    """A completed generation marks its checkpoints still queued for deletion as they land;
    one the queue dropped never lands, and the same request run again stores that state
    anew: it must stay."""
    from foretell.cache.codecs import snapshot_entry

    tier = tier_over(layout, codecs, spill_bytes=1)
    gate = threading.Event()
    real = tier.ssd.write
    monkeypatch.setattr(tier.ssd, "write", lambda e: gate.wait(10) and real(e))
    namespace = "generation:same-request"

    def checkpoint(n):
        tier.persist(snapshot_entry(range(n), [filled_kv(n)], codecs, namespace=namespace))

    for n in (2, 3, 6):  # 2 in flight, 3 dropped when 6 comes
        checkpoint(n)
    gate.set()
    tier._spill.drain(10)
    tier.discard(namespace)  # the first run completed, no flush since
    checkpoint(3)  # the second run's first checkpoint
    tier.flush(10)
    assert [len(s.tokens) for s in tier.checkpoints(namespace)] == [3]


def test_a_state_larger_than_the_ssd_cap_is_kept_in_ram_and_is_no_failure(layout, codecs,
                                                                           caplog):
    """Over the cap by configuration, not by fault: one warning saying so, RAM serves it,
    and flush (which a run's exit reports) has nothing it failed to write."""
    tier = tier_over(layout, codecs, ssd_bytes=1024)
    with caplog.at_level(logging.WARNING):
        for start in (0, 100):
            tier.store(range(start, start + 64), [filled_kv(64)])
        report = tier.flush(10)
    assert report.durable and report.failed == report.missing == 0
    assert sum("larger than the cache's cap" in r.message for r in caplog.records) == 1
    assert tier.lookup([*range(64), 1]).tier == "ram" and tier.ssd.entries() == []


def test_flush_reports_durable_once_everything_is_on_disk(layout, codecs):
    tier = tier_over(layout, codecs)
    for i in range(3):
        tier.store(range(10 * i, 10 * i + 5), [filled_kv(5)])
    report = tier.flush(10)
    assert report.durable and report.pending == report.dropped == report.failed == 0
    assert len(tier_over(layout, codecs).ssd.entries()) == 3


def test_a_full_disk_warns_once_keeps_serving_and_is_never_called_durable(
        layout, codecs, monkeypatch, caplog):
    tier = tier_over(layout, codecs)

    def full(*_args, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.WARNING):
        for i in range(3):
            tier.store(range(10 * i, 10 * i + 5), [filled_kv(5)])
        report = tier.flush(10)
    assert not report.durable and report.failed >= 3
    assert sum("disk full" in r.message for r in caplog.records) == 1
    assert tier.lookup([*range(5), 1]).tier == "ram"


def test_a_read_only_cache_directory_keeps_serving_from_ram(tmp_path, identity, codecs, caplog,
                                                           monkeypatch):
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    if os.access(root, os.W_OK):  # root ignores permissions: make the filesystem say it
        real_open = os.open

        def read_only(path, flags, *args):
            if flags & os.O_CREAT:
                raise OSError(errno.EROFS, "Read-only file system")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", read_only)
    try:
        tier = CacheTier(codecs, layout=SingleFileLayout(root, identity=identity))
        with caplog.at_level(logging.WARNING):
            for i in range(3):
                tier.store(range(10 * i, 10 * i + 5), [filled_kv(5)])
            assert not tier.flush(10).durable
        assert tier.lookup([*range(5), 1]).tier == "ram"
        assert sum("disk full or unwritable" in r.message for r in caplog.records) == 1
    finally:
        root.chmod(0o700)


def test_dropped_spills_are_rewritten_from_ram_by_flush(layout, codecs, monkeypatch):
    tier = tier_over(layout, codecs, spill_bytes=1)  # every queued snapshot but the newest drops
    gate = threading.Event()
    real_write = tier.ssd.write

    def slow_write(entry):
        gate.wait(10)
        return real_write(entry)

    monkeypatch.setattr(tier.ssd, "write", slow_write)
    for i in range(4):
        tier.store(range(10 * i, 10 * i + 5), [filled_kv(5)])
    assert tier._spill.dropped >= 1
    gate.set()
    report = tier.flush(10)
    assert report.durable and report.dropped >= 1
    assert len(tier.ssd.entries()) == 4


def test_a_dropped_spill_no_longer_in_ram_is_reported_missing(layout, codecs, monkeypatch):
    tier = tier_over(layout, codecs, spill_bytes=1)
    gate = threading.Event()
    real_write = tier.ssd.write
    monkeypatch.setattr(tier.ssd, "write", lambda e: gate.wait(10) and real_write(e))
    for i in range(3):
        tier.store(range(10 * i, 10 * i + 5), [filled_kv(5)])
    tier.ram.clear()
    gate.set()
    report = tier.flush(10)
    assert not report.durable and report.missing >= 1
    # Reported once: what can never reach the disk does not make every later flush fail.
    tier.store(range(100, 105), [filled_kv(5)])
    again = tier.flush(10)
    assert again.durable and again.missing == again.dropped == 0


def test_a_request_storing_after_its_tier_closed_keeps_going(layout, codecs):
    """A server closing the tier while a request still runs: the request's stores do not
    raise; RAM keeps the state and a later flush writes it."""
    tier = tier_over(layout, codecs)
    assert tier.close(10).durable
    tier.store(range(5), [filled_kv(5)])
    assert tier.lookup([*range(5), 1]).tier == "ram"
    report = tier.flush(10)
    assert report.durable and report.dropped == 1
    assert tier_over(layout, codecs).lookup([*range(5), 1]).tier == "ssd"


def test_flush_is_bounded_by_its_timeout(layout, codecs, monkeypatch):
    tier = tier_over(layout, codecs)
    gate = threading.Event()
    monkeypatch.setattr(tier.ssd, "write", lambda e: gate.wait(10))
    tier.store(range(5), [filled_kv(5)])
    report = tier.flush(0.2)
    gate.set()
    assert not report.durable and report.pending == 1


def test_foreign_entries_in_the_directory_are_never_served(layout, codecs, identity):
    import attrs

    other = attrs.evolve(identity, tokenizer_hash="another-tokenizer")
    writer = CacheTier(codecs, layout=SingleFileLayout(layout.directory.parent, identity=other))
    writer.store(range(12), [filled_kv(12)])
    assert writer.flush(10).durable
    assert tier_over(layout, codecs).lookup([*range(12), 1]).tier is None


def registered_layouts():
    from foretell.plugin import Kind, load_plugins

    registry = load_plugins().registry
    return [registry.get(Kind.LAYOUT, name) for name in registry.names(Kind.LAYOUT)]


@pytest.mark.parametrize("contribution", registered_layouts(), ids=lambda c: c.name)
def test_the_tier_restores_identically_over_every_registered_layout(
        tmp_path, identity, codecs, contribution):
    def open_tier():
        config = contribution.config() if contribution.config is not None else None
        return CacheTier(codecs, layout=contribution.load()(tmp_path, config, identity=identity))

    caches = [filled_kv(20), filled_rotating(12, max_size=16)]
    writer = open_tier()
    writer.store(range(12), [filled_kv(12), caches[1]])
    writer.store([*range(12), *range(50, 58)], [caches[0], filled_rotating(20, max_size=16)])
    assert writer.close(10).durable
    reuse = open_tier().lookup([*range(12), 99])  # restart-0: the snapshot still serves
    assert (reuse.tokens, reuse.tier) == (12, "ssd")
    np.testing.assert_array_equal(host(reuse.caches[1].state[0]), host(caches[1].state[0]))


def test_bfloat16_states_written_behind_restore_bit_exactly(layout, codecs):
    import mlx.core as mx

    caches = [filled_kv(20, dtype=mx.bfloat16), filled_rotating(20, max_size=16, dtype=mx.bfloat16)]
    stored_tier(layout, codecs, range(20), caches).close()
    reuse = tier_over(layout, codecs).lookup([*range(20), 1])
    assert reuse.tier == "ssd"
    for got, want in zip(reuse.caches, caches):
        for a, b in zip(got.state, want.state):
            assert a.dtype == mx.bfloat16
            np.testing.assert_array_equal(host(a.view(mx.uint16)), host(b.view(mx.uint16)))


def test_the_spill_worker_is_handed_row_contiguous_bfloat16(layout, codecs, monkeypatch):
    """A cache's state is a token slice of a larger buffer (strided). The writer thread
    reads tensors as memory and runs no MLX op: a strided bfloat16 array (which numpy
    cannot view without one) reaches it made contiguous by the tier."""
    import mlx.core as mx

    cache = filled_kv(20, dtype=mx.bfloat16)
    assert not all(memoryview(a).c_contiguous for a in cache.state)  # step slack: strided
    handed = []
    write = type(layout).write
    monkeypatch.setattr(type(layout), "write",
                        lambda self, entry: handed.append(entry) or write(self, entry))
    stored_tier(layout, codecs, range(20), [cache]).close()
    tensors = [t for entry in handed for layer in entry.layers for t in layer.tensors.values()]
    assert tensors and all(memoryview(t).c_contiguous for t in tensors)


def test_lookups_while_the_spill_worker_writes_never_see_a_partial_state(layout, codecs):
    tier = tier_over(layout, codecs)
    reference = {}
    for i in range(12):
        tokens = [*range(8), *range(100 * i, 100 * i + 4)]
        caches = [filled_kv(12 + i)]
        caches[0].trim(i)
        reference[tuple(tokens)] = host(caches[0].state[0])
        tier.store(tokens, caches)
        fresh = tier_over(layout, codecs)  # sees whatever the worker has renamed so far
        for stored in fresh.ssd.entries():
            entry = fresh.ssd.read(stored)
            assert entry is not None
            np.testing.assert_array_equal(host(entry.layers[0].tensors["keys"]),
                                          reference[stored.tokens])
    assert tier.flush(10).durable
    assert len(tier_over(layout, codecs).ssd.entries()) == 12


@pytest.mark.parametrize("rescan_s", [30.0, 0.0])  # 0: re-read the directory at each write
def test_a_ram_hit_keeps_the_stored_copy_from_being_evicted_first(layout, codecs, rescan_s):
    tier = tier_over(layout, codecs)
    tier.ssd.rescan_s = rescan_s
    for start in (0, 100):
        tier.store(range(start, start + 16), [filled_kv(16)])
        assert tier.flush(10).durable
    unit = max(s.header.nbytes for s in tier.ssd.entries())
    tier.lookup([*range(0, 16), 1])  # the older entry is used again, from RAM
    tier.ssd.max_bytes = 2 * unit + unit // 2
    tier.store(range(200, 216), [filled_kv(16)])
    assert tier.flush(10).durable
    assert sorted(s.tokens[0] for s in tier.ssd.entries()) == [0, 200]


def test_a_state_already_held_is_not_written_again(layout, codecs):
    tier = tier_over(layout, codecs)
    tier.store(range(16), [filled_kv(16)])
    assert tier.flush(10).durable
    tier.store(range(16), [filled_kv(16)])  # a RAM hit that computed only the last token
    tier.flush(10)
    assert tier.ssd.writes == 1


def test_processes_sharing_a_directory_hold_its_cap_together(layout, codecs, monkeypatch):
    """Each tier indexes what it found when it opened; a write re-reads the directory once
    its view is older than re-reading took (divided by RESCAN_SHARE), so entries another
    process stored since count against the cap (and can be served) instead of the directory
    growing past it."""
    from foretell.cache import ssd

    monkeypatch.setattr(ssd, "RESCAN_SHARE", 1.0)  # writes here are ms apart, as are re-reads
    probe = stored_tier(layout, codecs, range(500, 516), [filled_kv(16)])
    unit = probe.ssd.bytes()
    probe.ssd.remove(probe.ssd.entries()[0].header.key)
    cap = 3 * unit + unit // 2
    first = tier_over(layout, codecs, ssd_bytes=cap)
    second = tier_over(layout, codecs, ssd_bytes=cap)
    for i in range(6):  # the two take turns
        tier = (first, second)[i % 2]
        tier.store(range(100 * i, 100 * i + 16), [filled_kv(16)])
        assert tier.flush(10).durable
        assert tier_over(layout, codecs).ssd.bytes() <= cap
    # the survivors are the three stored last, whichever process stored them
    assert sorted(s.tokens[0] for s in tier_over(layout, codecs).ssd.entries()) == [300, 400, 500]
    # the other's entry stored before this one's last write: indexed, so served from disk
    assert first.lookup([*range(300, 316), 7]).tier == "ssd"


def test_writes_re_read_the_directory_only_as_often_as_re_reading_stays_cheap(
        layout, codecs, monkeypatch):
    """A write re-reads the directory when the view is older than the last re-read took,
    divided by RESCAN_SHARE: a directory that is cheap to re-read is re-read at each write,
    one that is slow to re-read is not re-read at every write."""
    from foretell.cache import ssd
    from foretell.cache.codecs import snapshot_entry

    clock = [100.0]
    monkeypatch.setattr(ssd.time, "monotonic", lambda: clock[0])
    scan_takes = [0.001]
    index = ssd.SsdIndex(layout, codecs, max_bytes=1 << 30)
    scans = []
    real = layout.scan

    def timed_scan():
        scans.append(clock[0])
        clock[0] += scan_takes[0]
        return real()

    monkeypatch.setattr(layout, "scan", timed_scan)
    index.scan()

    def write_after(seconds, start):
        clock[0] += seconds
        index.write(snapshot_entry(range(start, start + 8), [filled_kv(8)], codecs))

    write_after(0.05, 0)  # re-reading took 1 ms: a view 50 ms old is re-read
    assert len(scans) == 2
    scan_takes[0] = 0.1  # this re-read takes 100 ms: the next only once the view is 2 s old
    write_after(0.05, 100)
    assert len(scans) == 3
    write_after(1.0, 200)
    assert len(scans) == 3
    write_after(1.0, 300)
    assert len(scans) == 4
    assert len(index.entries()) == 4


def test_processes_that_wrote_at_once_leave_the_directory_within_the_cap_as_they_close(
        layout, codecs):
    """Short runs started together each index only what they found when they opened; the
    last to close re-reads the directory and evicts to the cap over all of it."""
    probe = stored_tier(layout, codecs, range(500, 516), [filled_kv(16)])
    unit = probe.ssd.bytes()
    probe.ssd.remove(probe.ssd.entries()[0].header.key)
    cap = 2 * unit + unit // 2
    runs = [tier_over(layout, codecs, ssd_bytes=cap) for _ in range(3)]  # opened together
    for tier in runs:  # writes within one view each (as where re-reading is slow)
        tier.ssd.rescan_s = 30.0
    for i, tier in enumerate(runs):
        tier.store(range(100 * i, 100 * i + 16), [filled_kv(16)])
        assert tier.flush(10).durable
    assert tier_over(layout, codecs).ssd.layout.bytes() > cap  # each within its own view
    for tier in runs:
        assert tier.close(10).durable
    assert tier_over(layout, codecs).ssd.layout.bytes() <= cap
