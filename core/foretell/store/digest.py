"""Tensor digests computed where the tensors live, so a GPU checks what landed on it.

A restore on a CUDA GPU reads each block into page-locked host memory and copies it to the
GPU by DMA. Hashing those bytes on the host (XXH3, :func:`foretell.store.format.checksum`)
made the verified read of the 4B shape's 604 MB entry 1.34-1.80x the unverified one on the
H200 host (docs/benchmarks.md): the host's memory and threads were the read's limit, and
the hash added to both. A device digest runs on the GPU after every block has landed and
checks the bytes where they will be used: one launch of a CUDA kernel over a table of the
tensors' addresses (:func:`_by_kernel`) where MLX runs on CUDA, MLX ops elsewhere and where
the kernel cannot be built (3.0 ms for the 4B shape's 604 MB on the H200; ~1.8 GB/s on a
CPU, where XXH3's 30 GB/s stays the check).

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

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from foretell.store.entry import Entry

if TYPE_CHECKING:
    import mlx.core as mx

#: How manifests name the digest.
SCHEME = "mlh64"
#: ``auto`` (or unset): digests on a CUDA GPU, where reads land on it; ``on``: wherever MLX
#: runs (the tests take the path on the CPU, where MLX digests at ~1.8 GB/s against XXH3's
#: 30: not a choice to make there); ``off``: never (host checksums only).
ENV = "FORETELL_DEVICE_DIGESTS"

log = logging.getLogger("foretell.store")

_MASK = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_WEIGHTS: list[Any] = []
_PREPARED = [0]
_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether entries get device digests when written and are checked by them when read
    here: on a CUDA GPU, unless :data:`ENV` says otherwise.

    :raises ConfigError: :data:`ENV` holds something else (naming it).
    """
    from foretell.platform.device import device_mode

    return device_mode(ENV, cuda="on", elsewhere="off", choices=("on", "off")) == "on"


def digests(arrays: Sequence[mx.array], views: Sequence[memoryview] | None = None
            ) -> list[int] | None:
    """Each array's digest, computed by MLX where it lives, in one evaluation; None when
    some array's bytes do not split into 32-bit words (then none is recorded). ``views``:
    writable flat views of the same (row-contiguous) buffers, as a read holds them; the
    CUDA kernel then reads the buffers at their addresses, with no MLX op per array."""
    import mlx.core as mx

    if any(a.nbytes % 4 for a in arrays):
        return None
    if not arrays:
        return []
    if _KERNEL_STATE[0] != "failed" and _on_cuda():
        try:
            return _by_kernel(arrays, views)
        except RuntimeError as exc:  # NVRTC missing or refusing: the ops give the same
            _KERNEL_STATE[0] = "failed"
            log.warning("device digests: the CUDA kernel failed (%s); using MLX ops", exc)
    words = [_words(a) for a in arrays]
    weights = _weights(max(w.size for w in words))
    sums = mx.stack([mx.sum(w.astype(mx.uint64) * weights[:w.size]) for w in words])
    return [int(s) for s in sums.tolist()]


def _words(array: mx.array) -> mx.array:
    import mlx.core as mx

    return array.reshape(-1) if array.dtype == mx.uint32 else array.reshape(-1).view(mx.uint32)


#: Tensors one launch of the CUDA kernel digests, one per row of its grid (CUDA's limit).
KERNEL_ROWS = 65_535
#: The most threads a tensor gets in a launch; each strides over its tensor's words.
KERNEL_THREADS = 1 << 16
_KERNEL: list[Any] = []
_KERNEL_STATE = ["untried"]
#: The kernel's name in its PTX form (``foretell.platform.ptx``).
PTX_NAME = "foretell_mlh64_table"
# The sum over one tensor's words, the tensor being row ``blockIdx.y`` of ``table``
# (address, words): the whole ``mx.fast.cuda_kernel`` form (MLX writes its signature from
# the input and output names), the body of the PTX form.
_BODY = """
    const unsigned int* words = (const unsigned int*)table[2 * blockIdx.y];
    const long long n = (long long)table[2 * blockIdx.y + 1];
    unsigned long long acc = 0;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
      unsigned long long z = (unsigned long long)(i + 1) * 0x9E3779B97F4A7C15ull;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z = (z ^ (z >> 31)) | 1ull;
      acc += (unsigned long long)words[i] * z;
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
      acc += __shfl_down_sync(0xffffffffu, acc, offset);
    }
    if ((threadIdx.x & 31) == 0 && acc != 0) {
      atomicAdd((unsigned long long*)&sums[blockIdx.y], acc);
    }
"""
#: The same kernel whole, needing no header (compiled once and kept: foretell.platform.ptx).
PTX_SOURCE = (f'extern "C" __global__ void {PTX_NAME}(\n'
              "    const unsigned long long* table, unsigned long long* sums) {"
              + _BODY + "}\n")


def _by_kernel(arrays: Sequence[mx.array], views: Sequence[memoryview] | None) -> list[int]:
    """The digests by one launch of a CUDA kernel over a table of the tensors' addresses
    and sizes (weights made on the fly, each word read once, no MLX op per tensor): the
    same sums the MLX ops compute. Launches and ops per tensor were what a check cost: in
    launches of 8 tensors, the check of the 4B shape's 216 tensors (8-bit KV) took 4.1-5.9
    ms of a 26 ms restore on the H200 (2026-12-05), where reading their 321 MB at the
    GPU's memory bandwidth takes under a tenth of a millisecond."""
    import mlx.core as mx

    with _LOCK:  # engines sharing a tier may write from two threads
        if not _KERNEL:
            _KERNEL.append(_launcher())
    if views is None:
        words = [_words(a) for a in arrays]
        mx.eval(words)  # kept alive (``words``) until the sums are back
        views = [_flat(w) for w in words]
    table = _table(views)
    found: list[int] = []
    for at in range(0, len(table), KERNEL_ROWS):
        found.extend(int(s) for s in _KERNEL[0](table[at:at + KERNEL_ROWS]).tolist())
    _KERNEL_STATE[0] = "works"
    return found


def _flat(array: mx.array) -> memoryview:
    return memoryview(array).cast("B") if array.size else memoryview(b"")


def _table(views: Sequence[memoryview]) -> Any:
    """The kernel's input: a row (address, 32-bit words) per view; an empty one reads
    nothing (its address is never used)."""
    import numpy as np

    from foretell.platform.cuda import address

    return np.array([(address(v) if v.nbytes else 0, v.nbytes // 4) for v in views],
                    dtype=np.uint64).reshape(-1, 2)


def _launcher() -> Any:
    """How a table of (address, words) rows is digested: by the kernel compiled from
    :data:`PTX_SOURCE` and kept (``foretell.platform.ptx``; each fresh process compiling
    the ``mx.fast.cuda_kernel`` form took ~2 s on the H200) once its digests of test
    arrays equal :func:`reference`'s, else by the ``mx.fast.cuda_kernel`` form."""
    import mlx.core as mx
    import numpy as np

    from foretell.platform import ptx
    from foretell.platform.kernels import custom_kernel

    def grid(table: Any) -> dict[str, Any]:
        widest = int(table[:, 1].max()) if len(table) else 0
        threads = min(KERNEL_THREADS, max(256, -(-widest // 256) * 256))
        return {"grid": (threads, len(table), 1), "threadgroup": (256, 1, 1),
                "output_shapes": [(len(table),)], "output_dtypes": [mx.uint64],
                "init_value": 0}

    def kept(compiled: bytes) -> Any:
        def by_ptx(table: Any) -> mx.array:
            return mx.fast.precompiled_cuda_kernel(
                name=PTX_NAME, compiled_source=compiled, inputs=[mx.array(table)],
                scalars=[], **grid(table))[0]
        return by_ptx

    def mismatch(launch: Any) -> str | None:
        tests = [np.arange(4099, dtype=np.uint32) * np.uint32(2654435761),
                 np.arange(37, dtype=np.uint32) + np.uint32(0xFFFFFF00),
                 np.zeros(0, dtype=np.uint32)]
        arrays = [mx.array(t) for t in tests]
        mx.eval(arrays)
        got = launch(_table([_flat(a) for a in arrays])).tolist()
        return None if got == [reference(t) for t in tests] else str(got)

    def fallback() -> Any:
        kernel = custom_kernel(PTX_NAME, _BODY, input_names=["table"],  # MLX writes the rest
                               output_names=["sums"])

        def by_jit(table: Any) -> mx.array:
            return kernel(inputs=[mx.array(table)], **grid(table))[0]
        return by_jit

    return ptx.checked(PTX_NAME, PTX_SOURCE, kept, mismatch, fallback)


def _on_cuda() -> bool:
    from foretell.platform.device import on_cuda

    return on_cuda()


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
    compiled and loaded, or the ops' weights built), now, where no request waits: in a
    fresh process on the H200 the first check by MLX ops of the 4B shape's entry took
    293 ms, the next ones 2.7."""
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
