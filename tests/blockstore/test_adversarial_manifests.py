"""What shares a block store's directory never stops its garbage collection: a manifest
of a block naming this reader does not know (another foretell's: skipped, and kept with
the blocks it lists), a directory or a FIFO named like an entry (listing nothing). The
tier's byte cap holds beside them, and ``collect()`` frees what only removed entries used."""

from __future__ import annotations

import json
import os
import struct

from blockfill import block_files, entry_of, listed_blocks

from foretell.cache.ssd import SsdIndex
from foretell.store import format as fmt


def resign(path, change) -> None:
    """Rewrite a manifest with ``change(fields)`` applied to its header and the header hash
    recomputed, as another foretell (or an adversary) writing a valid manifest would."""
    raw = path.read_bytes()
    index = json.loads(raw[8:])
    fields = json.loads(index["__metadata__"]["foretell.header"])
    change(fields)
    header = json.dumps(fields, separators=(",", ":"))
    index["__metadata__"]["foretell.header"] = header
    index["__metadata__"]["foretell.header_hash"] = fmt.header_hash(header)
    body = json.dumps(index, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body)


def unknown_naming(layout, codecs):
    """A manifest whose blocks are named by a hash this reader does not know, and the ids
    it lists."""
    theirs = entry_of(range(5000, 5011), codecs)
    assert layout.write(theirs)
    ids = set(listed_blocks(layout, theirs))
    path = layout.path(layout.key_for(theirs.tokens))

    def rename(fields):
        fields["block_id"] = "blake3"

    resign(path, rename)
    layout.scan()
    return path, ids


def stored_bytes(layout) -> int:
    return sum(p.stat().st_size for folder in (layout.entries_dir, layout.data_dir)
               for p in folder.iterdir() if p.is_file())


def test_a_manifest_of_an_unknown_block_naming_is_kept_with_its_blocks_and_stops_nothing(
        layout, codecs):
    path, theirs = unknown_naming(layout, codecs)
    assert str(path) in layout.skipped and "blake3" in layout.skipped[str(path)]
    ours = entry_of(range(11), codecs)
    assert layout.write(ours)
    only_ours = set(listed_blocks(layout, ours)) - theirs
    layout.remove(layout.key_for(ours.tokens))
    assert layout.collect() > 0
    assert not only_ours & block_files(layout)
    assert path.exists() and theirs <= block_files(layout)


def test_a_directory_or_fifo_named_like_an_entry_stops_no_collection(layout, codecs):
    layout.entries_dir.mkdir(parents=True)
    (layout.entries_dir / f"{'0' * 32}.safetensors").mkdir()
    os.mkfifo(layout.entries_dir / f"{'1' * 32}.safetensors")
    ours = entry_of(range(11), codecs)
    assert layout.write(ours)
    blocks = set(listed_blocks(layout, ours))
    layout.remove(layout.key_for(ours.tokens))
    assert layout.collect() > 0 and not blocks & block_files(layout)
    layout.scan()
    assert {os.path.basename(p) for p in layout.skipped} == {
        f"{'0' * 32}.safetensors", f"{'1' * 32}.safetensors"}


def test_the_tiers_cap_holds_beside_files_it_cannot_read(layout, codecs):
    """Under a cap of three entries, ten written one after another: what stays on disk
    besides the foreign manifest and its blocks is within the cap (with no block ever
    collected it had grown to all ten)."""
    path, theirs = unknown_naming(layout, codecs)
    (layout.entries_dir / f"{'0' * 32}.safetensors").mkdir()
    kept = path.stat().st_size + sum(layout.block_path(i).stat().st_size for i in theirs)
    entries = [entry_of(range(100 * i, 100 * i + 11), codecs) for i in range(1, 11)]
    index = SsdIndex(layout, codecs, max_bytes=1 << 30)
    assert index.write(entries[0])
    index.max_bytes = 3 * layout.bytes() + 64  # manifests' lengths vary by a few bytes
    for entry in entries[1:]:
        assert index.write(entry)
        assert stored_bytes(layout) - kept <= index.max_bytes
    assert len(index.entries()) == 3 and path.exists()
    assert theirs <= block_files(layout)
