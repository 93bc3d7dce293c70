"""The areas a whole entry passes through on a CUDA GPU: a read's landing area in device
memory, placed into the tensors by one kernel, and a write's page-locked area the driver
gathers a cache's tensors into by DMA (docs/decisions.md, "CUDA-only code", has what each
buys). The base classes are host memory copied by the CPU: the reference the tests run
anywhere.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

from foretell.platform.cuda import driver as drv
from foretell.platform.cuda.driver import _Driver, address

log = logging.getLogger("foretell.store")


class HostArea:
    """One contiguous area of host memory an entry's block bytes pass through, laid out as
    ``manifest.piece_plan`` lays them (each block's pieces back to back), held by one
    read or write at a time: :meth:`acquire` never waits (a caller that finds it held
    goes without). It grows to the largest entry asked for (in :data:`GRAIN` steps) and
    stays. The base class is plain host memory (what tests use anywhere); a write's area on
    a CUDA GPU is page-locked (:class:`PinnedArea`), a read's lives on the device
    (:class:`DeviceLandingArea`)."""

    #: Sizes are rounded up to this, so entries growing by a few tokens reuse the area.
    GRAIN = 64 << 20

    def __init__(self) -> None:
        self._busy = threading.Lock()
        self._base = 0
        self.nbytes = 0
        self._buffer: Any = None

    def acquire(self, nbytes: int) -> int | None:
        """The area's address, with room for ``nbytes``, held by the caller until
        :meth:`release`; None when another holds it.

        :raises CudaCopyError: no room for it (the caller is not holding it).
        """
        if not self._busy.acquire(blocking=False):
            return None
        try:
            self._grow(nbytes)
        except BaseException:
            self._busy.release()
            raise
        return self._base

    def release(self) -> None:
        self._busy.release()

    def reserve(self, nbytes: int) -> None:
        """Grow to ``nbytes`` now, where no request waits (unless it is held)."""
        if self._busy.acquire(blocking=False):
            try:
                self._grow(nbytes)
            finally:
                self._busy.release()

    def view(self, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` of the area from ``offset``, writable (host areas only)."""
        return memoryview(self._buffer).cast("B")[offset:offset + nbytes]

    def _grow(self, nbytes: int) -> None:
        if nbytes <= self.nbytes:
            return
        size = -(-nbytes // self.GRAIN) * self.GRAIN
        self._free()
        self._base, self.nbytes = self._allocate(size), size

    def _allocate(self, nbytes: int) -> int:
        self._buffer = bytearray(nbytes)
        return address(memoryview(self._buffer))

    def _free(self) -> None:
        self._buffer, self._base, self.nbytes = None, 0, 0


class PinnedArea(HostArea):
    """Page-locked host memory (``cuMemHostAlloc``), which the driver's copies from the
    GPU fill by DMA."""

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self._driver = driver

    def _allocate(self, nbytes: int) -> int:
        self._driver.check(self._driver.lib.cuCtxSetCurrent(self._driver.context),
                           "cuCtxSetCurrent")
        self._buffer = self._driver.pinned(nbytes)
        return ctypes.addressof(self._buffer)

    def _free(self) -> None:
        if self._buffer is not None:
            self._driver.check(self._driver.lib.cuMemFreeHost(ctypes.addressof(self._buffer)),
                               "cuMemFreeHost")
        super()._free()


class LandingArea(HostArea):
    """One contiguous scratch a whole entry's blocks land in, each staging slot by one copy,
    before :meth:`place` copies every run of bytes to its tensor in one pass: landed piece
    by piece, each piece's copy into its tensor is a strided DMA of one run per head, and
    quantized KV's small runs make that thousands of driver calls per entry. This base class
    is host memory placed by the CPU; on a CUDA GPU, :class:`DeviceLandingArea`.

    One restore holds it at a time (a restore that finds it held lands piece by piece).
    """

    def prepare(self, nbytes: int) -> None:
        """Ready a read of up to ``nbytes`` now, where no request waits: the area grown
        (unless a restore holds it) and what places runs loaded."""
        self.reserve(nbytes)

    def place(self, runs: Any) -> None:
        """Copy every run: ``runs`` is an ``(n, 3)`` uint64 array whose rows are (offset in
        the area, destination address, bytes). Returns once all have landed."""
        for offset, to, nbytes in runs.tolist():
            ctypes.memmove(to, self._base + offset, nbytes)


#: Threads of one block of the placing kernel, and the most blocks a launch has (each
#: block strides over runs: a run is 2 KiB to a few MiB).
PLACE_THREADS, PLACE_BLOCKS = 256, 4096
#: The placing kernel's name in its compiled and kept form (:mod:`.nvrtc`).
PLACE_NAME = "foretell_place_runs"
# Copies every run of ``runs`` (rows of source address, destination address, bytes).
_PLACE_BODY = """
    for (unsigned long long r = blockIdx.x; r < count; r += gridDim.x) {
      const unsigned long long from = runs[3 * r], to = runs[3 * r + 1], n = runs[3 * r + 2];
      const unsigned long long align = from | to | n;
      if ((align & 15ull) == 0) {
        const uint4* s = (const uint4*)from;
        uint4* d = (uint4*)to;
        for (unsigned long long i = threadIdx.x; i < n / 16; i += blockDim.x) d[i] = s[i];
      } else if ((align & 3ull) == 0) {
        const unsigned int* s = (const unsigned int*)from;
        unsigned int* d = (unsigned int*)to;
        for (unsigned long long i = threadIdx.x; i < n / 4; i += blockDim.x) d[i] = s[i];
      } else {
        const unsigned char* s = (const unsigned char*)from;
        unsigned char* d = (unsigned char*)to;
        for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
      }
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) placed[0] = count;
"""
#: The kernel whole, needing no header (compiled once with NVRTC and kept: :mod:`.nvrtc`).
PLACE_PTX_SOURCE = (f'extern "C" __global__ void {PLACE_NAME}(\n'
                    "    const unsigned long long* runs, const unsigned long long* counts,\n"
                    "    unsigned long long* placed) {\n"
                    "    const unsigned long long count = counts[0];" + _PLACE_BODY + "}\n")


def _place_launcher() -> Any:
    """How a table of runs (absolute addresses) is placed: by the kernel compiled from
    :data:`PLACE_PTX_SOURCE` and kept (:mod:`.nvrtc`), once it copies a test table of every
    alignment exactly. Returns once the runs have landed.

    :raises RuntimeError: no compiled form, or it fails its check (reads then land piece
        by piece: :func:`give_up_landing`).
    """
    import mlx.core as mx

    from foretell.platform.cuda import nvrtc

    def kept(compiled: bytes) -> Any:
        def by_ptx(table: Any) -> None:
            blocks = min(len(table), PLACE_BLOCKS)
            mx.eval(mx.fast.precompiled_cuda_kernel(
                name=PLACE_NAME, compiled_source=compiled,
                inputs=[mx.array(table), mx.array([len(table)], dtype=mx.uint64)],
                scalars=[], grid=(PLACE_THREADS * blocks, 1, 1),
                threadgroup=(PLACE_THREADS, 1, 1), output_shapes=[(1,)],
                output_dtypes=[mx.uint64])[0])
        return by_ptx

    return nvrtc.checked(PLACE_NAME, PLACE_PTX_SOURCE, kept,
                         lambda launch: None if _places_exactly(launch) else "other bytes")


def _places_exactly(launch: Any) -> bool:
    """Whether ``launch`` copies runs of 16-, 4- and 1-byte alignment between two GPU
    arrays exactly as the host does, touching nothing else."""
    import mlx.core as mx
    import numpy as np

    pattern = (np.arange(8192, dtype=np.uint32) * np.uint32(2654435761) >> np.uint32(13)
               ).astype(np.uint8)
    source = mx.array(pattern)
    target = mx.zeros((8192,), dtype=mx.uint8)
    mx.eval(source, target)
    src, dst = (address(memoryview(a).cast("B")) for a in (source, target))
    runs = [(0, 4096, 2048), (4, 16, 1000), (9, 3001, 777)]
    launch(np.array([[src + a, dst + b, n] for a, b, n in runs], dtype=np.uint64))
    want = np.zeros(8192, dtype=np.uint8)
    for a, b, n in runs:
        want[b:b + n] = pattern[a:a + n]
    return bool(np.array_equal(np.asarray(target), want))


class DeviceLandingArea(LandingArea):
    """Device memory of the GPU MLX runs on (``cuMemAlloc``: a 1-D copy into it was the
    fastest landing measured, docs/block-store.md, "Reads of 4 MiB"), placed by one CUDA
    kernel on MLX's stream that copies each run, 16 bytes a thread where the run allows it.
    Destinations are MLX buffers' managed memory, addressed as the staging copies address
    them."""

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self._driver = driver
        self._kernel: list[Any] = []

    def prepare(self, nbytes: int) -> None:
        """Also ready the kernel (its first load would otherwise be a restore's), by placing
        one empty run."""
        import numpy as np

        super().prepare(nbytes)
        if not self._kernel:
            self._launch(np.zeros((1, 3), dtype=np.uint64))

    def place(self, runs: Any) -> None:
        if not len(runs):
            return
        table = runs.copy()
        table[:, 0] += self._base
        self._launch(table)

    def _launch(self, table: Any) -> None:
        if not self._kernel:
            self._kernel.append(_place_launcher())
        self._kernel[0](table)

    def _allocate(self, nbytes: int) -> int:
        driver = self._driver
        driver.check(driver.lib.cuCtxSetCurrent(driver.context), "cuCtxSetCurrent")
        pointer = ctypes.c_uint64()
        driver.check(driver.lib.cuMemAlloc_v2(ctypes.byref(pointer), nbytes), "cuMemAlloc")
        return pointer.value

    def _free(self) -> None:
        if self._base:
            self._driver.check(self._driver.lib.cuMemFree_v2(self._base), "cuMemFree")
        super()._free()


_LANDING: list[LandingArea | None] = []
_WRITE_AREA: list[HostArea] = []
_LOCK = threading.Lock()


def landing() -> LandingArea | None:
    """The process's :class:`DeviceLandingArea` where reads land on a CUDA GPU
    (:func:`foretell.platform.cuda.driver.gpu_landing`); None elsewhere, or once it was
    given up (:func:`give_up_landing`)."""
    return _process_area(_LANDING, DeviceLandingArea)


def write_area() -> HostArea | None:
    """The process's :class:`PinnedArea`, which writes gather a cache's tensors into by DMA
    instead of reading their managed memory on the CPU (which moves their pages to the host
    for the next step to move back), where reads land on a CUDA GPU; None elsewhere."""
    return _process_area(_WRITE_AREA, PinnedArea)


def _process_area(kept: list[Any], make: Any) -> Any:
    """The one area ``kept`` holds for this process, made by ``make(driver)`` on first use
    where the driver answers; None otherwise (or once ``kept`` was given up)."""
    driver = drv.loaded()
    if driver is None:
        return None
    with _LOCK:
        if not kept:
            kept.append(make(driver))
        return kept[0]


def give_up_landing(exc: Exception) -> None:
    """The landing area's kernel failed (``exc``): warn once; :func:`landing` answers None
    from now on in this process, so reads land piece by piece."""
    with _LOCK:
        _LANDING[:] = [None]
    log.warning("reads land piece by piece from now on: the CUDA kernel placing whole "
                "entries failed (%s)", exc)
