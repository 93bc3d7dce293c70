"""Tensor digests computed where the tensors live, so a GPU checks what landed on it.

A restore on a CUDA GPU lands each block by DMA (``foretell.platform.cuda``); hashing those
bytes on the host (XXH3, :func:`foretell.store.format.checksum`) made the host's memory and
threads the verified read's limit. A device digest runs on the GPU after every block has
landed and checks the bytes where they will be used: one CUDA launch over every tensor
(``foretell.platform.cuda.digests``) where it can be had, else a few MLX ops per tensor, all
in one evaluation (docs/decisions.md, "CUDA-only code", has what each buys). On a CPU, XXH3
stays the check: MLX digests there at a fraction of its speed.

**The digest** (``mlh64``) of a tensor whose row-major bytes are the little-endian 32-bit
words ``x_0 .. x_{n-1}``: ``sum(x_i * w_i) mod 2**64``, with ``w_i`` the SplitMix64 output
for ``i`` made odd. It is a multilinear hash: for a given change of the bytes, a word's
difference ``d`` has at most 31 trailing zero bits, so with random odd weights the change
leaves the digest equal with probability at most ``2**-33`` (XXH3-64 and CRC-32 are in the
same class against damage; none of them resists an adversary, and the store does not claim
to). A tensor whose byte length is not a multiple of 4 has no digest.

:func:`reference` computes the same digest with numpy, independently of MLX: the tests'
oracle. Imported when plugins register: no mlx or numpy at import time.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from foretell.store.entry import Entry

if TYPE_CHECKING:
    import mlx.core as mx

#: How manifests name the digest.
SCHEME = "mlh64"

_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_WEIGHTS: list[Any] = []
_PREPARED = [0]
_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether entries get device digests when written and are checked by them when read
    here: where MLX computes on a CUDA GPU."""
    from foretell.platform.device import on_cuda

    return on_cuda()


def digests(arrays: Sequence[mx.array], views: Sequence[memoryview] | None = None
            ) -> list[int] | None:
    """Each array's digest, computed where it lives; None when some array's bytes do not
    split into 32-bit words (then none is recorded). On a CUDA GPU by one kernel launch
    (``views``: writable flat views of the same row-contiguous buffers, as a read holds
    them, which the kernel reads at their addresses), elsewhere or without the kernel by
    MLX ops, in one evaluation."""
    import mlx.core as mx

    from foretell.platform import device

    if any(a.nbytes % 4 for a in arrays):
        return None
    if not arrays:
        return []
    cuda = device.cuda_backend()
    found = cuda.digests.of(arrays, views) if cuda is not None else None
    if found is not None:
        return found
    words = [words_of(a) for a in arrays]
    weights = _weights(max(w.size for w in words))
    sums = mx.stack([mx.sum(w.astype(mx.uint64) * weights[:w.size]) for w in words])
    return [int(s) for s in sums.tolist()]


def words_of(array: mx.array) -> mx.array:
    """``array``'s bytes as 32-bit words, flat (a view where its layout allows)."""
    import mlx.core as mx

    return array.reshape(-1) if array.dtype == mx.uint32 else array.reshape(-1).view(mx.uint32)


def attach(entry: Entry) -> Entry:
    """``entry`` with the digests of its tensors (:attr:`Entry.digests`) where
    :func:`enabled`; as it is otherwise. Runs MLX ops: call where MLX runs (the tier does,
    as it hands an entry to its writer)."""
    if not enabled():
        return entry
    names = [(index, name) for index, layer in enumerate(entry.layers) for name in layer.tensors]
    found = digests([entry.layers[index].tensors[name] for index, name in names])
    return entry if found is None else attrs.evolve(entry, digests=dict(zip(names, found)))


def prepare(words: int) -> None:
    """Ready what a check of tensors of up to ``words`` 32-bit words runs (the CUDA kernel
    loaded, or the ops' weights built), now, where no request waits: a fresh process's
    first check pays for it, far longer than a restore's check takes."""
    import mlx.core as mx

    if words < 1 or words <= _PREPARED[0]:
        return
    digests([mx.zeros((words,), dtype=mx.uint32)])
    _PREPARED[0] = words


def _weights(n: int) -> mx.array:
    """SplitMix64 of ``0 .. n-1``, odd, on the default device; kept and grown, never rebuilt
    for fewer words."""
    import mlx.core as mx

    with _LOCK:
        if _WEIGHTS and _WEIGHTS[0].size >= n:
            return _WEIGHTS[0]
        size = max(n, 2 * _WEIGHTS[0].size if _WEIGHTS else n)
        z = (mx.arange(size, dtype=mx.uint64) + 1) * _u64(_GOLDEN)
        z = (z ^ (z >> 30)) * _u64(_MIX1)
        z = (z ^ (z >> 27)) * _u64(_MIX2)
        z = (z ^ (z >> 31)) | 1
        mx.eval(z)
        _WEIGHTS[:] = [z]
        return z


def _u64(value: int) -> mx.array:
    import mlx.core as mx
    import numpy as np

    return mx.array(np.uint64(value))


def reference(data: Any) -> int:
    """The digest of ``data``'s bytes (any buffer), computed with numpy alone."""
    import numpy as np

    raw = memoryview(data).cast("B")
    if len(raw) % 4:
        raise ValueError(f"{len(raw)} bytes do not split into 32-bit words")
    words = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (np.arange(len(words), dtype=np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = (z ^ (z >> np.uint64(31))) | np.uint64(1)
        return int(np.sum(words * z, dtype=np.uint64)) & _MASK
