"""Reads that land on a CUDA GPU: page-locked staging and the driver's copies into place.

MLX's CUDA build keeps every array in CUDA managed memory. Bytes written into such an array
from the CPU leave its pages on the host, and the GPU's first use then migrates them by page
faults; so a read lands its bytes in page-locked staging and the driver copies them by DMA
into buffers born on the GPU (docs/decisions.md, "CUDA-only code", has what it buys).

:class:`Staging` is the contract a layout's reader uses, one per reader thread
(:func:`staging`): ``slot(n)`` gives a writable buffer of ``n`` bytes whose previous copy
has finished, ``send(slot, runs)`` copies it into the destinations ``runs`` (in order),
``finish()`` returns once every copy has landed. The base class copies on the host (what
the tests exercise anywhere); :class:`CudaStaging` uses pinned memory and the driver,
through ``ctypes`` on ``libcuda.so.1`` (no build step, no extra dependency). Its slots come
from one pinned arena allocated when the driver loads (:func:`gpu_landing`).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any


class CudaCopyError(OSError):
    """A CUDA driver call failed: the read is not served (its files are not at fault)."""


class Staging:
    """Host staging for one reader thread: copies with the CPU (the reference behaviour)."""

    #: Slots handed out in turn, so a reader fills one while the other's copy runs.
    SLOTS = 2
    #: The least a slot holds, and so the most a reader reads in one call: reads of 4 MiB
    #: landed an entry faster than reads of 1 or 8 MiB (docs/block-store.md, "Reads").
    SLOT_BYTES = 4 << 20

    def __init__(self) -> None:
        self._slots: list[Any] = [None] * self.SLOTS
        self._turn = 0

    def slot(self, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes``, free to overwrite (its last copy has landed)."""
        index = self._turn % self.SLOTS
        self._turn += 1
        self._wait(index)
        if self._slots[index] is None or len(self._slots[index]) < nbytes:
            self._slots[index] = self._allocate(index, max(nbytes, self.SLOT_BYTES))
        return memoryview(self._slots[index]).cast("B")[:nbytes]

    def send(self, slot: memoryview, runs: list[memoryview]) -> None:
        """Copy ``slot``'s bytes into ``runs``, one after another."""
        offset = 0
        for run in runs:
            run[:] = slot[offset:offset + run.nbytes]
            offset += run.nbytes

    def send_to(self, slot: memoryview, to: int) -> None:
        """Copy ``slot``'s bytes, whole, to address ``to`` (in a landing area:
        :class:`foretell.platform.cuda.areas.LandingArea`)."""
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
#: Page-locked bytes pinned once, when the driver loads, and carved into reader slots: one
#: allocation instead of two per reader, which cost a fresh process's first restore.
#: Two slots for each of 8 readers.
ARENA_BYTES = 8 * Staging.SLOTS * Staging.SLOT_BYTES
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
        self.arena = self.pinned(ARENA_BYTES)
        self._arena_used, self._arena_lock = 0, threading.Lock()

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
        # Whether a slot is its own (freed when it grows) rather than carved from the arena.
        self._owned = [False] * self.SLOTS

    def send(self, slot: memoryview, runs: list[memoryview]) -> None:
        lib, check = self._driver.lib, self._driver.check
        source = address(slot)
        targets = [(address(run), run.nbytes) for run in runs if run.nbytes]
        if not targets:
            return
        pitch = targets[1][0] - targets[0][0] if len(targets) > 1 else 0
        width = targets[0][1]
        strided = (len(targets) > 1 and pitch >= width
                   and all(size == width for _a, size in targets)
                   and all(b[0] - a[0] == pitch for a, b in zip(targets, targets[1:])))
        if strided:
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
        # would move its pages to the host, and the GPU's next pass would move them back.
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


def address(view: memoryview) -> int:
    """The address of a writable buffer's first byte (an MLX buffer's managed memory on a
    CUDA GPU, where the device sees it at the same address)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_DRIVER: list[_Driver | None] = []
_LOCAL = threading.local()
_LOCK = threading.Lock()


def gpu_landing() -> bool:
    """Whether reads here should land on the GPU through :class:`CudaStaging`: MLX computes
    on a CUDA GPU and the driver answers. Decided once per process."""
    with _LOCK:
        if not _DRIVER:
            _DRIVER.append(_load_driver())
        return _DRIVER[0] is not None


def loaded() -> _Driver | None:
    """The process's driver where :func:`gpu_landing`; None otherwise."""
    return _DRIVER[0] if gpu_landing() else None


def compute_capability() -> tuple[int, int] | None:
    """The first visible GPU's compute capability (major, minor), asked of the driver; None
    where no driver answers."""
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


def staging() -> Staging:
    """This thread's staging: on the GPU where :func:`gpu_landing`, on the host otherwise."""
    found = getattr(_LOCAL, "staging", None)
    if found is None:
        driver = loaded()
        found = CudaStaging(driver) if driver is not None else Staging()
        _LOCAL.staging = found
    return found
