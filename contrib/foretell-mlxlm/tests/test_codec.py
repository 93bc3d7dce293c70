"""The mlx-lm codec passes foretell's codec suite for the cache kinds adapted models use."""

from __future__ import annotations

import pytest
from mlx_lm.models import cache as lm

from foretell.plugin.testing import check_cache_codec
from foretell_mlxlm.caches import MlxLmCacheCodec, adapt


@pytest.mark.parametrize("make", [
    pytest.param(lambda: adapt([lm.KVCache()])[0], id="kv"),
    pytest.param(lambda: adapt([lm.RotatingKVCache(max_size=1024)])[0], id="rotating"),
])
def test_the_mlx_lm_codec_passes_the_codec_suite(make):
    check_cache_codec(MlxLmCacheCodec(), make)


def test_a_recurrent_state_is_stored_but_never_served_shorter():
    codec = MlxLmCacheCodec()
    import mlx.core as mx

    (cache,) = adapt([lm.ArraysCache(size=2)])
    cache[0], cache[1] = mx.ones((1, 3, 4)), mx.zeros((1, 2, 8))
    cache._seen = 17
    tensors, meta = codec.snapshot(cache)
    back = codec.load(tensors, meta)
    assert back.offset == 17 and mx.array_equal(back[0], cache[0])
    assert not codec.header_trimmable(meta)
    assert codec.minimum_reusable_offset(meta) == 17
