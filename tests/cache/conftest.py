"""Fixtures for cache tests: the baseline codecs and a store identity."""

from __future__ import annotations

import pytest

from foretell.cache.codecs import RotatingKVCodec, StandardKVCodec
from foretell.store.entry import StoreIdentity


@pytest.fixture
def codecs():
    return [StandardKVCodec(), RotatingKVCodec()]


@pytest.fixture
def identity(codecs):
    return StoreIdentity(
        model_fingerprint="0123456789abcdef",
        model_id="test/tiny",
        tokenizer_hash="tok-aaaa",
        codec_providers=[c.provider_id for c in codecs],
    )


@pytest.fixture
def counted(monkeypatch):
    """``counted(module, name)``: the arguments of each call of ``module``'s function
    ``name`` from then on (how many comparisons a lookup makes, say)."""

    def count(module, name):
        calls, function = [], getattr(module, name)

        def counting(*args, **kwargs):
            calls.append(args)
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
        return calls

    return count
