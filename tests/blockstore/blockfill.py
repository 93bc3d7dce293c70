"""Entries whose tensor rows are a pure function of their tokens, so entries sharing a
prefix share bytes (as caches extended from one another do), and helpers to inspect a
block store's directory."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from foretell.cache.codecs import snapshot_entry
from foretell.model import KVCache, RotatingKVCache

HEADS, DIM = 2, 8


def token_rows(tokens, layer: int, dtype=mx.float32) -> mx.array:
    """``[1, HEADS, len(tokens), DIM]`` whose row t depends only on tokens[t] and t."""
    t = np.asarray(tokens, dtype=np.float32)[:, None]
    pos = np.arange(len(tokens), dtype=np.float32)[:, None]
    row = np.sin(t * 0.37 + pos * 0.11 + layer + np.arange(DIM, dtype=np.float32) * 0.5)
    return mx.array(np.stack([row, -row])[None]).astype(dtype)


def kv_of(tokens, layers: int = 2, dtype=mx.float32) -> list[KVCache]:
    caches = []
    for layer in range(layers):
        cache = KVCache()
        if tokens:
            rows = token_rows(tokens, layer, dtype)
            cache.update_and_fetch(rows, rows * 2)
        caches.append(cache)
    return caches


def entry_of(tokens, codecs, layers: int = 2, namespace: str = "", dtype=mx.float32):
    return snapshot_entry(list(tokens), kv_of(list(tokens), layers, dtype), codecs,
                          namespace=namespace)


def ring_of(n: int, max_size: int, seed: int = 0) -> RotatingKVCache:
    """A ring fed one token at a time (so it wraps in place, like decoding does)."""
    cache = RotatingKVCache(max_size)
    for t in range(n):
        rows = token_rows([seed + t], t)
        cache.update_and_fetch(rows, rows + 1)
    return cache


def host(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.asarray(a)


def assert_same_entry(got, want) -> None:
    assert got is not None
    assert got.tokens == want.tokens and got.namespace == want.namespace
    assert len(got.layers) == len(want.layers)
    for have, expect in zip(got.layers, want.layers):
        assert (have.codec, have.provider, dict(have.meta)) == (
            expect.codec, expect.provider, dict(expect.meta))
        assert set(have.tensors) == set(expect.tensors)
        for name, array in expect.tensors.items():
            assert have.tensors[name].dtype == array.dtype
            assert have.tensors[name].shape == array.shape
            assert np.array_equal(host(have.tensors[name]), host(array)), name


def block_files(layout) -> set[str]:
    if not layout.data_dir.exists():
        return set()
    return {p.name[:-4] for p in layout.data_dir.iterdir() if p.name.endswith(".blk")}


def manifest_files(layout) -> list[Path]:
    if not layout.entries_dir.exists():
        return []
    return sorted(p for p in layout.entries_dir.iterdir() if p.name.endswith(".safetensors"))


def listed_blocks(layout, entry) -> list[str]:
    """The block ids an entry's manifest lists, in order."""
    from foretell_blockstore import manifest as mf

    raw = layout.path(layout.key_for(entry.tokens, entry.namespace)).read_bytes()
    return [ref.id for ref in mf.parse(raw).blocks]


def sizes(layout, ids) -> int:
    return sum(layout.block_path(i).stat().st_size for i in ids)


def manifest_header(layout) -> dict:
    """The header JSON of the layout's one manifest, read as the bytes lie (not parsed by
    the code under test)."""
    import json

    [path] = manifest_files(layout)
    return json.loads(json.loads(path.read_bytes()[8:])["__metadata__"]["foretell.header"])


def flip_a_byte(path, at=-5, bit=0x01) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= bit
    path.write_bytes(bytes(raw))


def failing_staging(method: str, call: str) -> tuple[type, list[int]]:
    """A host staging whose ``method`` (``send`` or ``send_to``) fails as the CUDA driver
    call ``call`` does, and the list its waits for its copies (``finish``) are counted in."""
    from foretell.platform.cuda import driver

    finished: list[int] = []

    def fail(self, *args):
        raise driver.CudaCopyError(f"CUDA driver call {call} failed (CUresult 700)")

    def finish(self):
        finished.append(1)

    return type("Failing", (driver.Staging,), {method: fail, "finish": finish}), finished


def per_thread(make):
    """A staging stand-in: one ``make()`` per calling thread, as the real one keeps one
    staging per reader or writer thread."""
    import threading

    local = threading.local()

    def staging():
        if not hasattr(local, "staging"):
            local.staging = make()
        return local.staging

    return staging


def as_on_cuda(monkeypatch, *, gpu_landing: bool = True, staging=None, landing=None,
               write_area=None):
    """The block store's CUDA paths on any machine: the seam (``device.cuda_backend``)
    answers the CUDA package, whose reads land on the "GPU" as ``gpu_landing`` says, through
    ``staging`` (host staging, one per thread, unless given), whole into ``landing`` and
    whose writes gather into ``write_area`` (None: neither). Returns the package."""
    from foretell.platform import cuda, device

    monkeypatch.setattr(device, "cuda_backend", lambda: cuda)
    monkeypatch.setattr(cuda.driver, "gpu_landing", lambda: gpu_landing)
    monkeypatch.setattr(cuda.driver, "staging", staging or per_thread(cuda.driver.Staging))
    monkeypatch.setattr(cuda.areas, "landing", lambda: landing)
    monkeypatch.setattr(cuda.areas, "write_area", lambda: write_area)
    return cuda
