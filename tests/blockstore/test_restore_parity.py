"""An entry stored in blocks restores exactly as the single-file layout restores it: the
same tensors bit for bit, and greedy decoding from it emits the same tokens, for Qwen3,
Gemma models whose sliding window has wrapped, and quantized KV; also when its buffers come
from the restore reserve."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from foretell.cache.codecs import entry_trimmable, restore_caches, snapshot_entry
from foretell.cache.quantized import quantize_caches
from foretell.model import RotatingKVCache
from foretell.store.single_file import SingleFileLayout
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

# 11 prompt tokens; the last heads the first decode step, so 10 are stored: the Gemma
# sliding layers (window 8) have wrapped, and 3-token blocks cut every tensor unevenly.
PROMPT = [5, 17, 99, 3, 250, 42, 8, 8, 301, 77, 12]


@pytest.fixture(scope="module", params=[
    ("qwen3", None), ("gemma3_text", None), ("gemma4_text", None), ("qwen3", 8), ("qwen3", 4)],
    ids=lambda p: p[0] + (f"-kv{p[1]}" if p[1] else ""))
def tiny(request, tmp_path_factory):
    from foretell.model.loading import load
    from foretell.tools import make_model_dir

    model_type, kv_bits = request.param
    # Quantized KV groups run along head_dim, in groups of at least 32.
    overrides = {"head_dim": 32} if kv_bits else None
    path = make_model_dir(tmp_path_factory.mktemp(model_type), model_type, overrides=overrides)
    return load(path), kv_bits


def make_caches(model, kv_bits):
    caches = model.make_caches()
    return quantize_caches(caches, kv_bits, 32) if kv_bits else caches


def greedy(model, caches, last: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        hidden, _ = model.forward(mx.array([[last]]), caches)
        last = int(mx.argmax(model.logits(hidden)[0, -1]))
        out.append(last)
    return out


def test_block_store_restores_token_identically_to_single_file(tiny, tmp_path, identity, codecs):
    model, kv_bits = tiny
    caches = make_caches(model, kv_bits)
    model.forward(mx.array([PROMPT[:-1]]), caches)
    entry = snapshot_entry(PROMPT[:-1], caches, codecs)
    if any(isinstance(c, RotatingKVCache) for c in caches):
        assert not entry_trimmable(entry.layers, codecs)  # the ring really wrapped
    if kv_bits:
        assert any(layer.codec == "quantized-kv" for layer in entry.layers)

    single = SingleFileLayout(tmp_path / "single", identity=identity)
    blocks = BlockStoreLayout(tmp_path / "blocks", BlockStoreConfig(block_tokens=3),
                              identity=identity)
    assert single.write(entry) and blocks.write(entry)
    from_single = single.read(single.key_for(entry.tokens))
    from_blocks = blocks.read(blocks.key_for(entry.tokens))
    for a, b in zip(from_single.layers, from_blocks.layers):
        assert dict(a.meta) == dict(b.meta) and a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            assert a.tensors[name].dtype == b.tensors[name].dtype
            assert np.array_equal(np.asarray(a.tensors[name].view(mx.uint8)),
                                  np.asarray(b.tensors[name].view(mx.uint8)))

    blocks.replenish()  # the restore reserve: the next read carves its buffers from it
    from_reserve = blocks.read(blocks.key_for(entry.tokens))
    assert blocks.reserve.served == 1
    for a, b in zip(from_blocks.layers, from_reserve.layers):
        for name in a.tensors:
            assert a.tensors[name].dtype == b.tensors[name].dtype
            assert np.array_equal(np.asarray(a.tensors[name].view(mx.uint8)),
                                  np.asarray(b.tensors[name].view(mx.uint8)))

    expected = greedy(model, caches, PROMPT[-1], steps=6)
    assert greedy(model, restore_caches(from_single, codecs), PROMPT[-1], steps=6) == expected
    assert greedy(model, restore_caches(from_blocks, codecs), PROMPT[-1], steps=6) == expected
    assert greedy(model, restore_caches(from_reserve, codecs), PROMPT[-1], steps=6) == expected
