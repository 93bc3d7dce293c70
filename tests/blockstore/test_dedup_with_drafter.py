"""A drafter's state stored with an entry (its attachment layer) never defeats the block
store's sharing: entries sharing a long prefix share the target's blocks for it, even when
the drafter's state has as many rows as the target's KV and differs between them."""

from __future__ import annotations

import attrs
import mlx.core as mx
from blockfill import entry_of

from foretell.cache.attachment import ATTACHMENT_PROVIDER
from foretell.store.entry import Entry, LayerState
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout


def with_draft_state(tokens, codecs, seed: int) -> Entry:
    """The target's entry for ``tokens`` plus a drafter's state of as many rows, whose
    bytes differ from one entry to the next (as a drafter's prefill of another prompt
    length gives)."""
    target = entry_of(tokens, codecs)
    keys = mx.random.normal((1, 2, len(tokens), 8), key=mx.random.key(seed))
    state = LayerState(codec="draft-state", provider=ATTACHMENT_PROVIDER,
                       meta={"identity": "two-model:test", "offset": len(tokens), "seen": 0,
                             "ahead": [], "caches": [], "state": []},
                       tensors={"cache.0.keys": keys, "cache.0.values": -keys})
    return Entry(tokens=target.tokens, layers=(*target.layers, state))


def test_entries_with_a_drafters_state_share_the_targets_blocks_of_their_prefix(
        tmp_path, identity, codecs):
    identity = attrs.evolve(identity, codec_providers={*identity.codec_providers,
                                                       ATTACHMENT_PROVIDER})
    layout = BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
    prefix = list(range(100, 112))  # three whole blocks of 4 tokens
    first = with_draft_state(prefix + [1, 2, 3, 4], codecs, seed=1)
    second = with_draft_state(prefix + [5, 6, 7, 8], codecs, seed=2)
    assert layout.write(first)
    assert layout.write(second)
    target_block = entry_of(prefix[:4], codecs).tensor_bytes  # the target's rows of 4 tokens
    assert layout.bytes_reused >= 3 * target_block
    usage = layout.usage()
    assert usage.dedup_ratio > 1.2 and usage.blocks == 2 * 4 + 2 * 4 - 3
