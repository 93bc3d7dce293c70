"""What both built-in layouts' scans promise alike (``foretell.store.files.rescan`` and
``foretell.store.layout.ScanJournal`` under each); what each layout reads to decide is
in its own tests (test_blocks_layout.py, tests/cache/test_single_file_layout.py)."""

from __future__ import annotations

import pytest
from blockfill import entry_of

from foretell.store.single_file import SingleFileLayout
from foretell_blockstore.layout import BlockStoreLayout

#: Each layout, made over a cache root, and the method its scan reads one file with.
LAYOUTS = {
    "single-file": (lambda root, identity: SingleFileLayout(root, identity=identity),
                    "_scan_file"),
    "blocks": (lambda root, identity: BlockStoreLayout(root, identity=identity),
               "_scan_manifest"),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_scan_keeps_what_another_thread_removed_or_wrote_while_it_ran(
        tmp_path, identity, codecs, monkeypatch, name):
    """A scan swaps in the index it built from its listing: a removal or a write by
    another thread after the listing must survive the swap (a removed entry served from
    the index, a written one missing from it, and the byte count off, otherwise)."""
    make, scan_one = LAYOUTS[name]
    kept, removed, written = (entry_of(range(s, s + 8), codecs) for s in (0, 50, 100))
    first = make(tmp_path, identity)
    assert first.write(kept) and first.write(removed)
    fresh = make(tmp_path, identity)
    real = getattr(fresh, scan_one)

    def then_others_act(key, version):
        result = real(key, version)
        if key == fresh.key_for(removed.tokens):
            assert fresh.remove(key) and fresh.write(written)
        return result

    monkeypatch.setattr(fresh, scan_one, then_others_act)
    keys = {h.key for h in fresh.scan()}
    assert keys == {fresh.key_for(e.tokens) for e in (kept, written)}
    assert {h.key for h in fresh.headers()} == keys
    later = make(tmp_path, identity)
    assert {h.key for h in later.scan()} == keys and fresh.bytes() == later.bytes()
