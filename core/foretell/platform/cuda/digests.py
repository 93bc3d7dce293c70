"""Device digests (:mod:`foretell.store.digest`'s ``mlh64``) of many tensors in one CUDA
launch, over a table of their addresses: the position weights made on the fly, each word
read once, no MLX op per tensor. In a fresh process MLX's ops took several times as long
as the kernel to check a restored entry (docs/decisions.md, "CUDA-only code").

The kernel is kept on disk (:mod:`.nvrtc`) and used only once its digests of test arrays
equal :func:`foretell.store.digest.reference`'s: a kernel wrong in the same way for what is
written and what is read would pass every read. Where it cannot be had, :func:`of` answers
None and the caller's MLX ops compute the same sums.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from foretell.platform.cuda.driver import address

if TYPE_CHECKING:
    import mlx.core as mx

log = logging.getLogger("foretell.store")

#: Tensors one launch digests, one per row of its grid (CUDA's limit).
KERNEL_ROWS = 65_535
#: The most threads a tensor gets in a launch; each strides over its tensor's words.
KERNEL_THREADS = 1 << 16
#: The kernel's name in its compiled and kept form.
PTX_NAME = "foretell_mlh64_table"
#: The sum over one tensor's words, the tensor being row ``blockIdx.y`` of ``table``
#: (address, words); a complete source, needing no header.
PTX_SOURCE = f'extern "C" __global__ void {PTX_NAME}(' + """
    const unsigned long long* table, unsigned long long* sums) {
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
}
"""

#: The launch, once made; None once it could not be had (then never tried again).
_KERNEL: list[Any] = []
_LOCK = threading.Lock()


def of(arrays: Sequence[mx.array], views: Sequence[memoryview] | None = None
       ) -> list[int] | None:
    """Each array's digest, by one launch per :data:`KERNEL_ROWS` tensors; None where the
    kernel cannot be had or fails (one warning, then None for good). ``arrays``' bytes are
    whole 32-bit words. ``views``: writable flat views of the same row-contiguous buffers,
    as a read holds them (no MLX op then); otherwise the arrays' words are made contiguous
    and evaluated first."""
    import mlx.core as mx

    with _LOCK:  # engines sharing a tier may write from two threads
        if not _KERNEL:
            _KERNEL.append(_made())
        launch = _KERNEL[0]
    if launch is None:
        return None
    if views is None:
        from foretell.store.digest import words_of

        words = [words_of(a) for a in arrays]
        mx.eval(words)  # kept alive (``words``) until the sums are back
        views = [_flat(w) for w in words]
    table = _table(views)
    try:
        return [int(s) for at in range(0, len(table), KERNEL_ROWS)
                for s in launch(table[at:at + KERNEL_ROWS]).tolist()]
    except RuntimeError as exc:
        with _LOCK:
            _KERNEL[:] = [None]
        _warn(exc)
        return None


def _made() -> Any | None:
    try:
        return _launcher()
    except RuntimeError as exc:
        _warn(exc)
        return None


def _warn(exc: Exception) -> None:
    log.warning("device digests: the CUDA kernel failed (%s); using MLX ops", exc)


def _flat(array: mx.array) -> memoryview:
    return memoryview(array).cast("B") if array.size else memoryview(b"")


def _table(views: Sequence[memoryview]) -> Any:
    """The kernel's input: a row (address, 32-bit words) per view; an empty one reads
    nothing (its address is never used)."""
    import numpy as np

    return np.array([(address(v) if v.nbytes else 0, v.nbytes // 4) for v in views],
                    dtype=np.uint64).reshape(-1, 2)


def _launcher() -> Any:
    """How a table of (address, words) rows is digested: by the kernel compiled from
    :data:`PTX_SOURCE` and kept (:mod:`.nvrtc`), once its digests of test arrays equal
    :func:`foretell.store.digest.reference`'s.

    :raises RuntimeError: no compiled form, or it fails its check.
    """
    import mlx.core as mx
    import numpy as np

    from foretell.platform.cuda import nvrtc
    from foretell.store.digest import reference

    def kept(compiled: bytes) -> Any:
        def by_ptx(table: Any) -> mx.array:
            widest = int(table[:, 1].max()) if len(table) else 0
            threads = min(KERNEL_THREADS, max(256, -(-widest // 256) * 256))
            return mx.fast.precompiled_cuda_kernel(
                name=PTX_NAME, compiled_source=compiled, inputs=[mx.array(table)],
                scalars=[], grid=(threads, len(table), 1), threadgroup=(256, 1, 1),
                output_shapes=[(len(table),)], output_dtypes=[mx.uint64], init_value=0)[0]
        return by_ptx

    def mismatch(launch: Any) -> str | None:
        tests = [np.arange(4099, dtype=np.uint32) * np.uint32(2654435761),
                 np.arange(37, dtype=np.uint32) + np.uint32(0xFFFFFF00),
                 np.zeros(0, dtype=np.uint32)]
        arrays = [mx.array(t) for t in tests]
        mx.eval(arrays)
        got = launch(_table([_flat(a) for a in arrays])).tolist()
        return None if got == [reference(t) for t in tests] else str(got)

    return nvrtc.checked(PTX_NAME, PTX_SOURCE, kept, mismatch)
