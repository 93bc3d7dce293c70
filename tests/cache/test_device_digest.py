"""Device digests (foretell.store.digest): what MLX computes where a tensor lives equals the
numpy oracle over the tensor's bytes, and every damage a 32-bit weighted sum misses changes
it."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from foretell.store import digest


def _bytes(array: mx.array) -> bytes:
    """The array's row-major bytes, read by numpy (not by the code under test)."""
    if array.dtype == mx.bfloat16:
        return np.asarray(array.view(mx.uint16)).tobytes()
    return np.asarray(array).tobytes()


def test_mlx_digests_equal_the_numpy_oracle_for_every_stored_form():
    """On the device MLX computes on (a CUDA GPU where the suite runs there)."""
    base = mx.random.normal((1, 4, 40, 64), key=mx.random.key(0))
    arrays = [base.astype(mx.bfloat16), base, base[:, :, :17, :].astype(mx.bfloat16),
              mx.random.randint(0, 2**31, (1, 4, 40, 8), key=mx.random.key(1)).astype(mx.uint32),
              base.astype(mx.float16)[:, :, 3:, :], *_stored_forms()]
    mx.eval(arrays)
    assert digest.digests(arrays) == [digest.reference(_bytes(a)) for a in arrays]


def _stored_forms() -> list[mx.array]:
    """Arrays of every size class and layout a check meets: empty, odd word counts, slices
    that start past their buffer's first byte, a transpose (not row-contiguous), flat uint8
    views of the kind a read lands its blocks in."""
    sizes = [1, 3, 255, 4096, 65_537, 300_001]
    arrays = [mx.random.randint(0, 2**31, (n,), key=mx.random.key(n)).astype(mx.uint32)
              for n in sizes]
    base = mx.random.normal((2, 4, 64, 128), key=mx.random.key(7)).astype(mx.bfloat16)
    slab = mx.random.randint(0, 256, (4096,), key=mx.random.key(8)).astype(mx.uint8)
    return arrays + [base, base[1:], base[:, :, 5:, :], base.transpose(0, 2, 1, 3),
                     mx.zeros((0,), mx.uint32), slab[256:1280], slab[1536:4096]]


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
    monkeypatch.setattr(digest, "enabled", lambda: False)
    assert digest.attach(entry).digests == {}
    monkeypatch.setattr(digest, "enabled", lambda: True)
    found = digest.attach(entry).digests
    assert found == {(i, name): digest.reference(_bytes(t))
                     for i, layer in enumerate(entry.layers) for name, t in layer.tensors.items()}
    assert found  # two layers' keys and values


def test_digests_are_on_exactly_where_mlx_computes_on_a_cuda_gpu(monkeypatch):
    """No switch: on a CPU XXH3 is the faster check, on a CUDA GPU the digests are."""
    from foretell.platform import device

    monkeypatch.setattr(device, "on_cuda", lambda: False)
    assert digest.enabled() is False
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    assert digest.enabled() is True


def test_preparing_readies_a_check_of_that_size_once(monkeypatch):
    """The ops' weights built before a read needs them (where there is no kernel); a
    smaller size afterwards rebuilds nothing."""
    from foretell.platform import device

    monkeypatch.setattr(device, "cuda_backend", lambda: None)
    monkeypatch.setattr(digest, "_WEIGHTS", [])
    monkeypatch.setattr(digest, "_PREPARED", [0])
    digest.prepare(5000)
    assert digest._WEIGHTS[0].size >= 5000
    kept = list(digest._WEIGHTS)
    digest.prepare(100)
    assert digest._WEIGHTS == kept and digest._PREPARED == [5000]


def _host_table_kernel(table):
    """The kernel's contract on the host: each row (address, words) summed by the oracle
    from the bytes at that address."""
    import ctypes

    return mx.array(np.array([digest.reference(ctypes.string_at(int(a), int(n) * 4))
                              for a, n in table.tolist()], dtype=np.uint64))


@pytest.fixture
def table_kernel(monkeypatch):
    """The CUDA path on the CPU: the seam answers the CUDA package, whose kernel is the
    host stand-in, in launches of 5 tensors."""
    from foretell.platform import cuda, device

    monkeypatch.setattr(device, "cuda_backend", lambda: cuda)
    monkeypatch.setattr(cuda.digests, "_KERNEL", [_host_table_kernel])
    monkeypatch.setattr(cuda.digests, "KERNEL_ROWS", 5)
    return cuda.digests


def test_the_table_of_addresses_points_at_every_tensors_bytes(table_kernel, monkeypatch):
    """The kernel reads each tensor at the address and length its table gives: for arrays
    of every layout (their words made contiguous first) and for a read's flat views of the
    same buffers, the table's bytes are the tensors' (here read on the host), and the MLX
    ops are not what computed them."""
    monkeypatch.setattr(digest, "_weights", None)  # the ops would fail
    arrays = _stored_forms() + [mx.arange(16, dtype=mx.uint32) + i for i in range(12)]
    mx.eval(arrays)
    assert digest.digests(arrays) == [digest.reference(_bytes(a)) for a in arrays]
    flat = [a for a in arrays if a.nbytes == 0 or memoryview(a).c_contiguous]
    views = [memoryview(a).cast("B") for a in flat]
    assert digest.digests(flat, views=views) == [digest.reference(_bytes(a)) for a in flat]


def test_a_kernel_that_fails_leaves_the_ops_to_digest_with_one_warning(table_kernel,
                                                                      monkeypatch, caplog):
    """Where NVRTC is missing or refuses the kernel, reads still get checked: by the ops,
    which compute the same digests."""
    import logging

    calls = []

    def failing():
        calls.append(1)
        raise RuntimeError("kernel foretell_mlh64_table has no compiled form")

    monkeypatch.setattr(table_kernel, "_KERNEL", [])
    monkeypatch.setattr(table_kernel, "_launcher", failing)
    arrays = [mx.arange(40, dtype=mx.uint32), mx.arange(8, dtype=mx.uint32)]
    with caplog.at_level(logging.WARNING, logger="foretell.store"):
        for _ in range(2):
            assert digest.digests(arrays) == [digest.reference(_bytes(a)) for a in arrays]
    assert calls == [1]  # tried once
    assert sum("CUDA kernel failed" in r.message for r in caplog.records) == 1


def _on_a_cuda_gpu() -> bool:
    from foretell.platform import device

    return device.cuda_backend() is not None


@pytest.mark.skipif(not _on_a_cuda_gpu(), reason="the kernel runs on a CUDA GPU")
def test_the_cuda_kernel_equals_the_oracle(monkeypatch):
    from foretell.platform import cuda

    arrays = _stored_forms()
    mx.eval(arrays)
    expected = [digest.reference(_bytes(a)) for a in arrays]
    assert cuda.digests.of(arrays) == expected  # the kernel itself, not the ops
    flat = [a for a in arrays if a.nbytes == 0 or memoryview(a).c_contiguous]
    views = [memoryview(a).cast("B") for a in flat]
    assert cuda.digests.of(flat, views) == [digest.reference(_bytes(a)) for a in flat]
    monkeypatch.setattr(cuda.digests, "KERNEL_ROWS", 5)
    assert cuda.digests.of(arrays) == expected
