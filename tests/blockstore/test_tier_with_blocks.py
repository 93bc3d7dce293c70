"""The SSD tier over the block store: its byte cap sees each shared block once, and the
blocks only a superseded or evicted entry used are freed."""

from __future__ import annotations

from blockfill import block_files, entry_of

from foretell.cache.ssd import SsdIndex


def shared_prefix_entries(codecs):
    prefix = list(range(16))
    return [entry_of(prefix + [100 + i] * 4, codecs) for i in range(4)]


def test_the_tier_cap_counts_shared_blocks_once(layout, codecs):
    entries = shared_prefix_entries(codecs)
    index = SsdIndex(layout, codecs, max_bytes=1 << 30)
    for entry in entries:
        assert index.write(entry)
    logical = sum(h.nbytes for h in layout.headers())
    # Summing the entries' own sizes would overshoot by more than a whole entry.
    assert index.bytes() == layout.bytes() < logical - entries[0].tensor_bytes

    capped = SsdIndex(layout, codecs, max_bytes=layout.bytes())
    capped.scan()
    assert capped.evictions == 0 and len(capped.entries()) == 4
    for stored in capped.entries():
        assert capped.read(stored) is not None


def test_evicting_to_the_cap_frees_only_blocks_no_other_entry_uses(layout, codecs):
    entries = shared_prefix_entries(codecs)
    index = SsdIndex(layout, codecs, max_bytes=1 << 30)
    for entry in entries:
        index.write(entry)
    before = layout.bytes()
    # Under what is stored by more than a rewrite can change: the rewritten manifest's
    # created_at is a float whose JSON length varies by a few bytes (at before - 1 a
    # rewrite one byte shorter left nothing to evict, 1 CI run in 3).
    index.max_bytes = before - 64
    index.write(entries[-1])  # rewriting the newest runs the cap: the oldest entry goes
    assert index.evictions == 1 and len(index.entries()) == 3
    assert before - layout.bytes() < entries[0].tensor_bytes  # its prefix blocks stay
    for stored in index.entries():
        assert index.read(stored) is not None


def test_a_superseded_checkpoints_own_blocks_are_collected(layout, codecs):
    index = SsdIndex(layout, codecs, max_bytes=1 << 30)
    index.write(entry_of(range(10), codecs))  # blocks rows 0-3, 4-7, 8-9
    index.write(entry_of(range(14), codecs))  # serves range(10): supersedes it
    assert [len(s.tokens) for s in index.entries()] == [14]
    # Rows 0-3 and 4-7 are shared; the old partial block 8-9 is gone, 8-11 and 12-13 new.
    assert len(block_files(layout)) == 4
