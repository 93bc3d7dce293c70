"""Reads checked by device digests (foretell.store.digest): on a CUDA GPU every tensor is
digested where it landed instead of each piece being hashed on the host. Here MLX's CPU
stands in for the GPU (``digest.enabled`` patched): the manifest records what the writer
computed, a read checks every byte by it and hashes no piece, and damage is never served,
its block still named and deleted."""

from __future__ import annotations

import json
import logging

import mlx.core as mx
import numpy as np
import pytest
from blockfill import (
    assert_same_entry,
    entry_of,
    flip_a_byte,
    listed_blocks,
    manifest_files,
    manifest_header,
)

from foretell.store import digest
from foretell.store import format as fmt
from foretell.store.layout import CorruptEntry


@pytest.fixture
def on(monkeypatch):
    """Device digests on, as on a CUDA GPU."""
    monkeypatch.setattr(digest, "enabled", lambda: True)


def _hashed_pieces(monkeypatch) -> list[int]:
    """Counts the piece checksums computed from here on."""
    calls, checksum = [], fmt.checksum
    monkeypatch.setattr(fmt, "checksum", lambda *parts: calls.append(1) or checksum(*parts))
    return calls


def test_the_manifest_records_each_tensors_digest_over_its_bytes(layout, codecs, on):
    entry = digest.attach(entry_of(range(10), codecs, dtype=mx.bfloat16))
    assert layout.write(entry)
    header = manifest_header(layout)
    assert header["device_digest"] == digest.SCHEME
    for group in header["groups"]:
        for (index, name), recorded in zip(group["tensors"], group["digests"]):
            tensor = entry.layers[index].tensors[name]
            raw = np.asarray(tensor.view(mx.uint16)).tobytes()
            assert int(recorded, 16) == digest.reference(raw)


def test_a_read_checks_by_the_digests_and_hashes_no_piece(layout, codecs, on, monkeypatch):
    entry = digest.attach(entry_of(range(1100), codecs, dtype=mx.bfloat16))
    assert layout.write(entry)
    hashed = _hashed_pieces(monkeypatch)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert hashed == [] and layout.last_check == f"{digest.SCHEME} on the device"


@pytest.mark.parametrize("block", [0, 1, 2])
def test_a_flipped_byte_is_never_served_and_its_block_is_deleted(layout, codecs, on, caplog,
                                                                  block):
    """Without the digests' check this read would serve the damage: no piece is hashed."""
    entry = digest.attach(entry_of(range(10), codecs))
    assert layout.write(entry)
    path = layout.block_path(listed_blocks(layout, entry)[block])
    flip_a_byte(path)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.read(layout.key_for(entry.tokens)) is None
    assert sum("dropped" in r.message for r in caplog.records) == 1
    assert not manifest_files(layout) and not path.exists()


def test_a_tensor_that_fails_its_digest_is_refused_though_every_block_passes(
        layout, codecs, on, caplog):
    entry = digest.attach(entry_of(range(10), codecs))
    wrong = {k: (v + 1 if k == (1, "values") else v) for k, v in entry.digests.items()}
    import attrs

    assert layout.write(attrs.evolve(entry, digests=wrong))
    blocks = set(listed_blocks(layout, entry))
    key = layout.key_for(entry.tokens)
    with pytest.raises(CorruptEntry, match=r"layers\.1\.values fails its device digest"):
        layout.read_layers(key)
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        assert layout.read(key) is None
    assert not manifest_files(layout)
    assert all(layout.block_path(b).exists() for b in blocks)  # no block was at fault


def test_digests_are_recorded_for_all_tensors_or_none(layout, codecs, on):
    import attrs

    entry = digest.attach(entry_of(range(10), codecs))
    partial = dict(list(entry.digests.items())[1:])
    assert layout.write(attrs.evolve(entry, digests=partial))
    assert "device_digest" not in manifest_header(layout)
    assert_same_entry(layout.read(layout.key_for(entry.tokens)), entry)
    assert layout.last_check == f"{fmt.CHECKSUM} per piece"


def test_an_entry_without_digests_is_checked_piece_by_piece(layout, codecs, on, monkeypatch):
    entry = entry_of(range(10), codecs)  # written where digests were off
    assert layout.write(entry)
    key = layout.key_for(entry.tokens)
    hashed = _hashed_pieces(monkeypatch)
    assert_same_entry(layout.read(key), entry)
    assert hashed and layout.last_check == f"{fmt.CHECKSUM} per piece"
    flip_a_byte(layout.block_path(listed_blocks(layout, entry)[0]))
    assert layout.read(key) is None


def test_a_reader_without_digests_still_checks_every_piece(layout, codecs, monkeypatch):
    monkeypatch.setattr(digest, "enabled", lambda: True)
    entry = digest.attach(entry_of(range(10), codecs))
    assert layout.write(entry)
    monkeypatch.setattr(digest, "enabled", lambda: False)  # a CPU host reading a GPU's store
    key = layout.key_for(entry.tokens)
    assert_same_entry(layout.read(key), entry)
    assert layout.last_check == f"{fmt.CHECKSUM} per piece"
    flip_a_byte(layout.block_path(listed_blocks(layout, entry)[0]))
    assert layout.read(key) is None


def test_a_manifest_with_a_malformed_digest_list_is_corrupt(layout, codecs, on):
    from foretell_blockstore import manifest as mf

    entry = digest.attach(entry_of(range(10), codecs))
    assert layout.write(entry)
    header = manifest_header(layout)
    header["groups"][0]["digests"] = header["groups"][0]["digests"][1:]
    body = json.dumps(header, separators=(",", ":"))
    index = {"__metadata__": {"foretell.format_version": mf.FORMAT_VERSION,
                              "foretell.header": body, "foretell.header_hash": fmt.header_hash(body)}}
    raw = json.dumps(index).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with pytest.raises(CorruptEntry, match="device digests do not fit"):
        mf.parse(len(raw).to_bytes(8, "little") + raw)


def test_the_tier_hands_its_writer_entries_with_digests(layout, codecs, on):
    from blockfill import kv_of

    from foretell.cache.tier import CacheTier

    tier = CacheTier(codecs, layout=layout)
    tier.store(range(10), kv_of(list(range(10))))
    assert tier.flush(10).durable
    assert manifest_header(layout)["device_digest"] == digest.SCHEME


def test_replenish_readies_the_digests_for_the_largest_stored_tensor(layout, codecs, on,
                                                                     monkeypatch):
    monkeypatch.setattr(digest, "_PREPARED", [0])
    assert layout.write(digest.attach(entry_of(range(30), codecs)))
    layout.replenish()
    largest = max(t.nbytes for layer in entry_of(range(30), codecs).layers
                  for t in layer.tensors.values())
    assert digest._PREPARED[0] == largest // 4


def test_an_empty_store_still_readies_the_check_its_first_write_needs(layout, on, monkeypatch):
    monkeypatch.setattr(digest, "_PREPARED", [0])
    layout.replenish()
    assert digest._PREPARED[0] >= 1


def test_a_tier_over_a_layout_that_records_no_digests_computes_none(tmp_path, identity, codecs,
                                                                    on, monkeypatch):
    """The single-file layout keeps its XXH3 checksums only: digests for it would be GPU
    work thrown away at every write."""
    from blockfill import kv_of

    from foretell.cache.tier import CacheTier
    from foretell.store.single_file import SingleFileLayout

    computed, digests = [], digest.digests
    monkeypatch.setattr(digest, "digests", lambda arrays: computed.append(1) or digests(arrays))
    tier = CacheTier(codecs, layout=SingleFileLayout(tmp_path, identity=identity))
    tier.store(range(10), kv_of(list(range(10))))
    assert tier.flush(10).durable and computed == []


def test_a_layout_that_says_it_records_no_digests_gets_none(layout, codecs, on, monkeypatch):
    """``records_device_digests = False`` is heard, not only the attribute's presence."""
    from blockfill import kv_of

    from foretell.cache.tier import CacheTier

    computed, digests = [], digest.digests
    monkeypatch.setattr(digest, "digests", lambda arrays: computed.append(1) or digests(arrays))
    monkeypatch.setattr(layout, "records_device_digests", False, raising=False)
    tier = CacheTier(codecs, layout=layout)
    tier.store(range(10), kv_of(list(range(10))))
    assert tier.flush(10).durable and computed == []
