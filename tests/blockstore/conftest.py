"""Fixtures for block-store tests: the baseline codecs (quantized KV included), a store
identity, and a layout with small blocks."""

from __future__ import annotations

import pytest

from foretell.cache.codecs import RotatingKVCodec, StandardKVCodec
from foretell.cache.quantized import QuantizedKVCodec
from foretell.store.entry import StoreIdentity
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout


@pytest.fixture
def codecs():
    return [StandardKVCodec(), RotatingKVCodec(), QuantizedKVCodec()]


@pytest.fixture
def identity(codecs):
    return StoreIdentity(
        model_fingerprint="0123456789abcdef",
        model_id="test/tiny",
        tokenizer_hash="tok-aaaa",
        codec_providers=[c.provider_id for c in codecs],
    )


@pytest.fixture
def layout(tmp_path, identity):
    return BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)
