"""Device digests (foretell.store.digest): what MLX computes where a tensor lives equals the
numpy oracle over the tensor's bytes, and every damage a 32-bit weighted sum misses changes
it."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from foretell.errors import ConfigError
from foretell.store import digest


def _bytes(array: mx.array) -> bytes:
    """The array's row-major bytes, read by numpy (not by the code under test)."""
    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16)).tobytes()
    return np.asarray(array).tobytes()


def test_mlx_digests_equal_the_numpy_oracle_for_every_stored_form():
    base = mx.random.normal((1, 4, 40, 64), key=mx.random.key(0))
    arrays = [base.astype(mx.bfloat16), base, base[:, :, :17, :].astype(mx.bfloat16),
              mx.random.randint(0, 2**31, (1, 4, 40, 8), key=mx.random.key(1)).astype(mx.uint32),
              base.astype(mx.float16)[:, :, 3:, :]]
    mx.eval(arrays)
    assert digest.digests(arrays) == [digest.reference(_bytes(a)) for a in arrays]


def test_a_tensor_not_made_of_whole_words_has_no_digest():
    assert digest.digests([mx.zeros((3,), dtype=mx.uint8), mx.zeros((4,))]) is None
    with pytest.raises(ValueError, match="32-bit words"):
        digest.reference(b"abc")


def test_any_flipped_bit_changes_the_digest():
    data = bytearray(random.Random(0).randbytes(64))
    before = digest.reference(data)
    for bit in range(8 * len(data)):
        data[bit // 8] ^= 1 << (bit % 8)
        assert digest.reference(data) != before, bit
        data[bit // 8] ^= 1 << (bit % 8)


def test_top_bits_flipped_in_two_words_change_it():
    """The damage a weighted sum of 32-bit words mod 2**32 cannot see (each such flip adds
    2**31 whatever the odd weight); in 64 bits each word's weight still tells."""
    data = bytearray(random.Random(1).randbytes(256))
    before = digest.reference(data)
    for first, second in [(0, 1), (3, 40), (10, 63), (0, 63)]:
        damaged = bytearray(data)
        damaged[4 * first + 3] ^= 0x80
        damaged[4 * second + 3] ^= 0x80
        assert digest.reference(damaged) != before, (first, second)


def test_words_swapped_between_places_change_it():
    data = bytearray(b"".join(i.to_bytes(4, "little") for i in range(16)))
    swapped = bytearray(data)
    swapped[0:4], swapped[4:8] = data[4:8], data[0:4]
    assert digest.reference(swapped) != digest.reference(data)


def test_attach_digests_every_tensor_where_enabled(monkeypatch):
    from foretell.cache.codecs import StandardKVCodec, snapshot_entry
    from foretell.model import KVCache

    caches = [KVCache(), KVCache()]
    for cache in caches:
        rows = mx.random.normal((1, 2, 9, 8)).astype(mx.bfloat16)
        cache.update_and_fetch(rows, -rows)
    entry = snapshot_entry(list(range(9)), caches, [StandardKVCodec()])
    monkeypatch.setenv(digest.ENV, "off")
    assert digest.attach(entry).digests == {}
    monkeypatch.setenv(digest.ENV, "on")
    found = digest.attach(entry).digests
    assert found == {(i, name): digest.reference(_bytes(t))
                     for i, layer in enumerate(entry.layers) for name, t in layer.tensors.items()}
    assert found  # two layers' keys and values


def test_a_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(digest.ENV, "sometimes")
    with pytest.raises(ConfigError, match=digest.ENV):
        digest.enabled()


def test_preparing_readies_a_check_of_that_size_once(monkeypatch):
    """The kernel compiled (CUDA) or the weights built (the MLX ops) before a read needs
    them; a smaller size afterwards rebuilds nothing."""
    monkeypatch.setattr(digest, "_WEIGHTS", [])
    monkeypatch.setattr(digest, "_PREPARED", [0])
    digest.prepare(5000)
    if digest._KERNEL_STATE[0] == "works":
        assert digest._KERNEL and not digest._WEIGHTS
    else:
        assert digest._WEIGHTS[0].size >= 5000
    kept = list(digest._WEIGHTS)
    digest.prepare(100)
    assert digest._WEIGHTS == kept and digest._PREPARED == [5000]


def _stored_forms() -> list[mx.array]:
    """Arrays of every size class and layout a check meets: empty, odd word counts,
    slices that start past their buffer's first byte, a transpose (not row-contiguous)."""
    sizes = [1, 3, 255, 4096, 65_537, 300_001, *([2048] * 12)]
    arrays = [mx.random.randint(0, 2**31, (n,), key=mx.random.key(n)).astype(mx.uint32)
              for n in sizes]
    base = mx.random.normal((2, 4, 64, 128), key=mx.random.key(7)).astype(mx.bfloat16)
    arrays += [base, base[1:], base[:, :, 5:, :], base.transpose(0, 2, 1, 3),
               mx.zeros((0,), mx.uint32)]
    mx.eval(arrays)
    return arrays


def _host_table_kernel(table):
    """The kernel's contract on the host: each row (address, words) summed by the oracle
    from the bytes at that address."""
    import ctypes

    return mx.array(np.array([digest.reference(ctypes.string_at(int(a), int(n) * 4))
                              for a, n in table.tolist()], dtype=np.uint64))


def test_the_table_of_addresses_points_at_every_tensors_bytes(monkeypatch):
    """The kernel reads each tensor at the address and length its table gives: for arrays
    of every layout (their words made contiguous first) and for a read's flat views of the
    same buffers, the table's bytes are the tensors' (here read on the host)."""
    monkeypatch.setattr(digest, "_on_cuda", lambda: True)
    monkeypatch.setattr(digest, "_KERNEL", [_host_table_kernel])
    monkeypatch.setattr(digest, "_KERNEL_STATE", ["untried"])
    monkeypatch.setattr(digest, "KERNEL_ROWS", 5)  # several launches
    arrays = _stored_forms()
    expected = [digest.reference(_bytes(a)) for a in arrays]
    assert digest.digests(arrays) == expected
    _digests_from_views_equal_the_oracle(arrays)
    assert digest._KERNEL_STATE[0] == "works"


def _digests_from_views_equal_the_oracle(arrays: list[mx.array]) -> None:
    """What a read passes: the row-contiguous buffers and flat views of them."""
    flat = [a for a in arrays if a.nbytes == 0 or memoryview(a).c_contiguous]
    views = [memoryview(a).cast("B") for a in flat]
    assert digest.digests(flat, views=views) == [digest.reference(_bytes(a)) for a in flat]


@pytest.mark.skipif(not (mx.cuda.is_available() and mx.default_device() == mx.gpu),
                    reason="the kernel runs on a CUDA GPU")
def test_the_cuda_kernel_equals_the_oracle(monkeypatch):
    arrays = _stored_forms()
    expected = [digest.reference(_bytes(a)) for a in arrays]
    assert digest.digests(arrays) == expected
    assert digest._KERNEL_STATE[0] == "works"
    _digests_from_views_equal_the_oracle(arrays)
    monkeypatch.setattr(digest, "KERNEL_ROWS", 5)
    assert digest.digests(arrays) == expected


def test_a_kernel_that_fails_leaves_the_ops_to_digest_with_one_warning(monkeypatch, caplog):
    """Where NVRTC is missing or refuses the kernel, reads still get checked: by the ops,
    which compute the same digests."""
    import logging

    calls = []

    def failing(arrays, views):
        calls.append(len(arrays))
        raise RuntimeError("nvrtc: no such library")

    monkeypatch.setattr(digest, "_on_cuda", lambda: True)
    monkeypatch.setattr(digest, "_by_kernel", failing)
    monkeypatch.setattr(digest, "_KERNEL_STATE", ["untried"])
    arrays = [mx.arange(40, dtype=mx.uint32), mx.arange(8, dtype=mx.uint32)]
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        for _ in range(2):
            assert digest.digests(arrays) == [digest.reference(_bytes(a)) for a in arrays]
    assert calls == [2]  # tried once
    assert sum("CUDA kernel failed" in r.message for r in caplog.records) == 1
