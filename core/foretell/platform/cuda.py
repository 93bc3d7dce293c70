"""Reads that land on a CUDA GPU: page-locked staging and the driver's copies into place.

MLX's CUDA build keeps every array in CUDA managed memory. A read that writes restored bytes
into such an array from the CPU leaves its pages on the host (after a first touch of fresh
memory there), and the GPU's first use then migrates them by page faults. Measured on the
H200 host for 604 MB of page-cached bytes in fresh processes
(``docs/bench-data/2026-12-01-h200-cuda-landing-1637.log``): zero-filling the buffers on
8 CPU streams 64 ms, reading into them 27 ms, the GPU's first pass over them 59 ms (151 ms
in all); with the buffers born on the GPU, the bytes read into page-locked staging and
copied by DMA: 42 + 31 + 8 ms (85 ms; ``dd`` of the file took 69 ms). A staging slot is
contiguous, so its checksum is one call over it, which releases the GIL and scales over
readers where many small calls do not.

:class:`Staging` is the contract a layout's reader uses, one per reader thread
(:func:`staging`): ``slot(n)`` gives a writable buffer of ``n`` bytes whose previous copy
has finished, ``send(slot, runs)`` copies it into the destinations ``runs`` (in order),
``finish()`` returns once every copy has landed. The base class copies on the host (what a
test exercises anywhere); :class:`CudaStaging` uses pinned memory and the driver, through
``ctypes`` on ``libcuda.so.1`` (no build step, no extra dependency). Its slots come from one
pinned arena allocated when the driver loads (:func:`prepare`, called as a layout opens).
Through the block store, a fresh process's verified read of the 604 MB entry took 107-111 ms
(33-41 of them the zero fill on the GPU) and the GPU's first pass over it 7-9 ms
(``docs/block-store.md#what-verification-costs``).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any


class CudaCopyError(OSError):
    """A CUDA driver call failed: the read is not served (its files are not at fault)."""


class Staging:
    """Host staging for one reader thread: copies with the CPU (the reference behaviour)."""

    #: Slots handed out in turn, so a reader fills one while the other's copy runs.
    SLOTS = 2

    def __init__(self) -> None:
        self._slots: list[Any] = [None] * self.SLOTS
        self._turn = 0

    def slot(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes``, free to overwrite (its last copy has landed)."""
        index = self._turn % self.SLOTS
        self._turn += 1
        self._wait(index)
        if self._slots[index] is None or len(self._slots[index]) < nbytes:
            self._slots[index] = self._allocate(index, max(nbytes, SLOT_BYTES))
        return memoryview(self._slots[index]).cast("B")[:nbytes]

    def send(self, slot: memoryview, runs: list[memoryview]) -> None:
        """Copy ``slot``'s bytes into ``runs``, one after another."""
        offset = 0
        for run in runs:
            run[:] = slot[offset:offset + run.nbytes]
            offset += run.nbytes

    def send_to(self, slot: memoryview, to: int) -> None:
        """Copy ``slot``'s bytes, whole, to address ``to`` (in a :class:`LandingArea`)."""
        ctypes.memmove(to, address(slot), slot.nbytes)

    def fetch(self, into: memoryview, first: int, width: int, count: int, pitch: int) -> None:
        """Copy ``count`` runs of ``width`` bytes, the first at address ``first`` and each
        ``pitch`` bytes after the last, back to back into ``into`` (the reverse of
        :meth:`send`: a write's piece gathered from its tensor). Landed after
        :meth:`finish`."""
        to = address(into)
        for k in range(count):
            ctypes.memmove(to + k * width, first + k * pitch, width)

    def finish(self) -> None:
        """Return once every copy sent has landed."""

    def _wait(self, index: int) -> None:
        pass

    def _allocate(self, index: int, nbytes: int) -> Any:
        return bytearray(nbytes)


class _Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
                ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_MEMORY_HOST, _MEMORY_UNIFIED = 1, 4
#: The least a staging slot holds, and so the most a reader reads in one call: on the H200
#: host, 8 readers landing 604 MB on the GPU took 73 ms in reads of 1 MiB and 46 ms in reads
#: of 4 MiB (each 1 MiB piece still copied and hashed on its own; 49 ms at 8 MiB;
#: docs/block-store.md, "Reads").
SLOT_BYTES = 4 << 20
#: Page-locked bytes pinned once, when the driver loads, and carved into reader slots: one
#: allocation instead of two per reader (16 calls of 1 MiB took 12-29 ms of a fresh
#: process's first restore on the H200 host). Two slots for each of 8 readers.
ARENA_BYTES = 8 * 2 * SLOT_BYTES
_STREAM_NON_BLOCKING, _EVENT_DISABLE_TIMING = 1, 2


class _Driver:
    """The CUDA driver calls staging needs, on the device's primary context (MLX's)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        self.check(lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self.check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self.context = ctypes.c_void_p()
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device),
                   "cuDevicePrimaryCtxRetain")
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                                             ctypes.c_void_p]
        lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                       ctypes.c_uint]
        for name in ("cuStreamSynchronize", "cuEventSynchronize", "cuMemFreeHost",
                     "cuCtxSetCurrent"):
            getattr(lib, name).argtypes = [ctypes.c_void_p]
        lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        self.arena, self._arena_used, self._arena_lock = self.pinned(ARENA_BYTES), 0, threading.Lock()

    def pinned(self, nbytes: int) -> Any:
        """``nbytes`` of page-locked host memory (a ctypes char array), for good."""
        pointer = ctypes.c_void_p()
        self.check(self.lib.cuMemHostAlloc(ctypes.byref(pointer), nbytes, 0), "cuMemHostAlloc")
        return (ctypes.c_char * nbytes).from_address(pointer.value)

    def from_arena(self, nbytes: int) -> Any | None:
        """A slot carved from the arena pinned when the driver loaded, or None once it is
        used up (slots live as long as their reader threads, which the pool keeps)."""
        nbytes = -(-nbytes // 4096) * 4096
        with self._arena_lock:
            if self._arena_used + nbytes > ARENA_BYTES:
                return None
            begin, self._arena_used = self._arena_used, self._arena_used + nbytes
        return (ctypes.c_char * nbytes).from_address(ctypes.addressof(self.arena) + begin)

    @staticmethod
    def check(result: int, call: str) -> None:
        if result != 0:
            raise CudaCopyError(f"CUDA driver call {call} failed (CUresult {result})")


class CudaStaging(Staging):
    """Pinned slots copied to the GPU by DMA on this thread's own stream; a slot is reused
    once the copy that last read it has finished (an event per slot)."""

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self._driver, lib = driver, driver.lib
        driver.check(lib.cuCtxSetCurrent(driver.context), "cuCtxSetCurrent")
        self._stream = ctypes.c_void_p()
        driver.check(lib.cuStreamCreate(ctypes.byref(self._stream), _STREAM_NON_BLOCKING),
                     "cuStreamCreate")
        self._events = []
        for _ in range(self.SLOTS):
            event = ctypes.c_void_p()
            driver.check(lib.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING),
                         "cuEventCreate")
            self._events.append(event)
        self._sent = [False] * self.SLOTS
        self._owned = [False] * self.SLOTS  # a slot of its own (freed when it grows), not the arena's

    def send(self, slot: memoryview, runs: list[memoryview]) -> None:
        lib, check = self._driver.lib, self._driver.check
        source = address(slot)
        targets = [(address(run), run.nbytes) for run in runs if run.nbytes]
        if not targets:
            return
        pitch = targets[1][0] - targets[0][0] if len(targets) > 1 else 0
        width = targets[0][1]
        if len(targets) > 1 and all(size == width for _a, size in targets) and pitch >= width and all(
                b[0] - a[0] == pitch for a, b in zip(targets, targets[1:])):
            copy = _Memcpy2D(srcMemoryType=_MEMORY_HOST, srcHost=source, srcPitch=width,
                             dstMemoryType=_MEMORY_UNIFIED, dstDevice=targets[0][0],
                             dstPitch=pitch, WidthInBytes=width, Height=len(targets))
            check(lib.cuMemcpy2DAsync_v2(ctypes.byref(copy), self._stream), "cuMemcpy2DAsync")
        else:
            offset = 0
            for to, size in targets:
                check(lib.cuMemcpyHtoDAsync_v2(to, source + offset, size, self._stream),
                      "cuMemcpyHtoDAsync")
                offset += size
        self._sent_last()

    def send_to(self, slot: memoryview, to: int) -> None:
        self._driver.check(self._driver.lib.cuMemcpyHtoDAsync_v2(
            to, address(slot), slot.nbytes, self._stream), "cuMemcpyHtoDAsync")
        self._sent_last()

    def fetch(self, into: memoryview, first: int, width: int, count: int, pitch: int) -> None:
        # A DMA from where the tensor lives: a CPU read of managed memory the GPU holds
        # moves its pages to the host (604 MB: 304-403 ms) and the GPU's next pass over it
        # pays to move them back (43-57 ms against 0.6); this copy took 12.2 ms and cost the
        # GPU nothing after (scripts/managed_read_probe.py, H200, 2026-12-04).
        lib, check = self._driver.lib, self._driver.check
        copy = _Memcpy2D(srcMemoryType=_MEMORY_UNIFIED, srcDevice=first, srcPitch=pitch,
                         dstMemoryType=_MEMORY_HOST, dstHost=address(into), dstPitch=width,
                         WidthInBytes=width, Height=count)
        check(lib.cuMemcpy2DAsync_v2(ctypes.byref(copy), self._stream), "cuMemcpy2DAsync")

    def _sent_last(self) -> None:
        """Mark the slot handed out last as read by the copies just queued on the stream."""
        index = (self._turn - 1) % self.SLOTS
        self._driver.check(self._driver.lib.cuEventRecord(self._events[index], self._stream),
                           "cuEventRecord")
        self._sent[index] = True

    def finish(self) -> None:
        self._driver.check(self._driver.lib.cuStreamSynchronize(self._stream),
                           "cuStreamSynchronize")
        self._sent = [False] * self.SLOTS

    def _wait(self, index: int) -> None:
        if self._sent[index]:
            self._driver.check(self._driver.lib.cuEventSynchronize(self._events[index]),
                               "cuEventSynchronize")
            self._sent[index] = False

    def _allocate(self, index: int, nbytes: int) -> Any:
        old = self._slots[index]
        if old is not None and self._owned[index]:
            self._driver.check(self._driver.lib.cuMemFreeHost(ctypes.addressof(old)),
                               "cuMemFreeHost")
        self._slots[index] = None
        slot = self._driver.from_arena(nbytes)
        self._owned[index] = slot is None
        return self._driver.pinned(nbytes) if slot is None else slot


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
    before :meth:`place` copies every run of bytes to its tensor in one pass.

    Landing piece by piece, each piece's copy from its slot into its tensor is a strided
    DMA of one run per head: for 8-bit KV, whose scales and biases are 4 bytes a row, that
    is 1,728 driver calls of 2-64 KiB runs per 4B-shape entry, and its restore on the H200
    read at 39-55% of ``dd`` (docs/block-store.md). Landed whole, a slot is one copy, and
    the runs are placed by one kernel. This base class is host memory placed by the CPU
    (the reference the tests run anywhere); on a CUDA GPU, :class:`DeviceLandingArea`.

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
#: The placing kernel's name in its compiled and kept form (``foretell.platform.ptx``).
PLACE_NAME = "foretell_place_runs"
# Copies every run of ``runs`` (rows of source address, destination address, bytes);
# ``count`` and ``placed`` are set by each form.
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
#: The body as ``mx.fast.cuda_kernel`` wraps it (MLX writes the signature).
_PLACE_SOURCE = "    const unsigned long long count = runs_shape[0];" + _PLACE_BODY
#: The same kernel whole, needing no header.
PLACE_PTX_SOURCE = (f'extern "C" __global__ void {PLACE_NAME}(\n'
                    "    const unsigned long long* runs, const unsigned long long* counts,\n"
                    "    unsigned long long* placed) {\n"
                    "    const unsigned long long count = counts[0];" + _PLACE_BODY + "}\n")


def _place_launcher() -> Any:
    """How a table of runs (absolute addresses) is placed: by the kernel compiled from
    :data:`PLACE_PTX_SOURCE` and kept (``foretell.platform.ptx``; the
    ``mx.fast.cuda_kernel`` form took 1.7-2.5 s to ready in each fresh process on the
    H200) once it copies a test table of every alignment exactly, else by the
    ``mx.fast.cuda_kernel`` form. Either returns once the runs have landed."""
    import mlx.core as mx

    from foretell.platform import ptx
    from foretell.platform.kernels import custom_kernel

    def grid(table: Any) -> dict[str, Any]:
        blocks = min(len(table), PLACE_BLOCKS)
        return {"grid": (PLACE_THREADS * blocks, 1, 1), "threadgroup": (PLACE_THREADS, 1, 1),
                "output_shapes": [(1,)], "output_dtypes": [mx.uint64]}

    def kept(compiled: bytes) -> Any:
        def by_ptx(table: Any) -> None:
            mx.eval(mx.fast.precompiled_cuda_kernel(
                name=PLACE_NAME, compiled_source=compiled,
                inputs=[mx.array(table), mx.array([len(table)], dtype=mx.uint64)],
                scalars=[], **grid(table))[0])
        return by_ptx

    def fallback() -> Any:
        kernel = custom_kernel(PLACE_NAME, _PLACE_SOURCE, input_names=["runs"],
                               output_names=["placed"])

        def by_jit(table: Any) -> None:
            mx.eval(kernel(inputs=[mx.array(table)], **grid(table))[0])
        return by_jit

    return ptx.checked(PLACE_NAME, PLACE_PTX_SOURCE, kept,
                       lambda launch: None if _places_exactly(launch) else "other bytes",
                       fallback)


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
    fastest landing measured, 27.9 ms for 604 MB against 46.1 into managed memory piece by
    piece; docs/block-store.md, "Reads of 4 MiB"), placed by one CUDA kernel on MLX's
    stream that copies each run, 16 bytes a thread where the run allows it. Destinations
    are MLX buffers' managed memory, addressed as the staging copies address them."""

    def __init__(self, driver: _Driver) -> None:
        super().__init__()
        self._driver = driver
        self._kernel: list[Any] = []

    def prepare(self, nbytes: int) -> None:
        """Also ready the kernel (in a fresh process on the H200 the ``mx.fast.cuda_kernel``
        form's first launch took 2.2 s: a restore must not pay it), by placing one empty
        run."""
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


def address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (an MLX buffer's managed memory on a
    CUDA GPU, where the device sees it at the same address)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_DRIVER: list[_Driver | None] = []
_LANDING: list[LandingArea | None] = []
_WRITE_AREA: list[HostArea] = []
_LOCAL = threading.local()
_LOCK = threading.Lock()


def gpu_landing() -> bool:
    """Whether reads here should land on the GPU through :class:`CudaStaging`: MLX computes
    on a CUDA GPU and the driver answers. Decided once per process."""
    with _LOCK:
        if not _DRIVER:
            _DRIVER.append(_load_driver())
        return _DRIVER[0] is not None


def prepare() -> None:
    """Decide :func:`gpu_landing` now (loading the driver and pinning the staging arena) if
    MLX is already loaded, as where an engine runs: a layout opening with its tier pays it,
    not the first restore. A process without MLX (``foretell cache ls``) loads nothing."""
    if "mlx.core" in sys.modules:
        gpu_landing()
        write_area()  # a bad FORETELL_WRITE_DMA fails as the store opens, not at a write


def compute_capability() -> tuple[int, int] | None:
    """The first visible GPU's compute capability (9, 0 on an H200), asked of the driver;
    None where no driver answers."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        if (lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(device), 0)
                or lib.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # ..._MAJOR
                or lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)):  # ..._MINOR
            return None
    except (OSError, AttributeError):
        return None
    return major.value, minor.value


def _load_driver() -> _Driver | None:
    from foretell.platform.device import on_cuda

    if not on_cuda():
        return None
    try:
        return _Driver()
    except (OSError, AttributeError):
        return None


def landing() -> LandingArea | None:
    """The process's :class:`DeviceLandingArea` where :func:`gpu_landing`; None elsewhere
    (reads there land in place, straight from the file)."""
    return _process_area(_LANDING, DeviceLandingArea)


#: ``on`` or ``auto`` (the default): on a CUDA GPU a write gathers an entry's pieces by DMA
#: into a page-locked area (:func:`write_area`) instead of reading the tensors' managed
#: memory on the CPU, which moved their pages to the host for the next step to move back
#: (the H200, 8-bit 4B entry: the first RAM hits after a write 56 and 40 ms against 20,
#: by DMA 22 and 17 against 17; docs/block-store.md, "Writes by DMA"); ``off``: on the CPU.
WRITE_DMA = "FORETELL_WRITE_DMA"


def write_area() -> HostArea | None:
    """The process's :class:`PinnedArea` for writes where :data:`WRITE_DMA` turns them on
    and reads land on a CUDA GPU (:func:`gpu_landing`); None otherwise.

    :raises ConfigError: :data:`WRITE_DMA` holds something else (naming it).
    """
    from foretell.platform.device import device_mode

    if device_mode(WRITE_DMA, cuda="on", elsewhere="off", choices=("on", "off")) != "on":
        return None
    return _process_area(_WRITE_AREA, PinnedArea)


def _process_area(kept: list[Any], make: Any) -> Any:
    """The one area ``kept`` holds for this process, made by ``make(driver)`` on first use
    where reads land on a CUDA GPU and the driver answers; None otherwise (or once ``kept``
    was given up: :func:`give_up_landing`)."""
    if not gpu_landing():
        return None
    with _LOCK:
        if not _DRIVER or _DRIVER[0] is None:
            return None
        if not kept:
            kept.append(make(_DRIVER[0]))
        return kept[0]


def give_up_landing(exc: Exception) -> None:
    """The landing area's kernel failed (``exc``): warn once; :func:`landing` answers None
    from now on in this process, so reads land piece by piece."""
    import logging

    with _LOCK:
        _LANDING[:] = [None]
    logging.getLogger("foretell.store").warning(
        "reads land piece by piece from now on: the CUDA kernel placing whole entries "
        "failed (%s)", exc)


def staging() -> Staging:
    """This thread's staging: on the GPU where :func:`gpu_landing`, on the host otherwise."""
    found = getattr(_LOCAL, "staging", None)
    if found is None:
        found = CudaStaging(_DRIVER[0]) if gpu_landing() else Staging()
        _LOCAL.staging = found
    return found
