"""A stand-in for ``libcuda.so.1`` that does what each driver call the staging makes would do,
in host memory: "device" addresses are host addresses, copies are ``memmove``s honouring
``CUDA_MEMCPY2D``'s fields as the driver does, allocations are host buffers kept alive.
With it ``foretell.platform.cuda.driver``'s code (its structs, pitches, offsets, the order
of its calls) runs on any machine; the piece-by-piece path through it, which has run on
the H200, checks the stand-in itself."""

from __future__ import annotations

import ctypes
import threading

from foretell.platform.cuda import driver as drv


class FakeLibcuda:
    INVALID_VALUE = 1

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._kept: dict[int, object] = {}

    def _alloc(self, nbytes: int) -> int:
        buffer = ctypes.create_string_buffer(max(nbytes, 1))
        self._kept[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def cuMemHostAlloc(self, pointer, nbytes, flags):  # noqa: N802 - the driver's names
        self.calls.append("cuMemHostAlloc")
        pointer._obj.value = self._alloc(nbytes)
        return 0

    def cuMemAlloc_v2(self, pointer, nbytes):  # noqa: N802
        self.calls.append("cuMemAlloc")
        pointer._obj.value = self._alloc(nbytes)
        return 0

    def cuMemFreeHost(self, address):  # noqa: N802
        self.calls.append("cuMemFreeHost")
        return 0 if self._kept.pop(address, None) is not None else self.INVALID_VALUE

    def cuMemFree_v2(self, address):  # noqa: N802
        self.calls.append("cuMemFree")
        return 0 if self._kept.pop(address, None) is not None else self.INVALID_VALUE

    def cuMemcpyHtoDAsync_v2(self, to, source, nbytes, stream):  # noqa: N802
        self.calls.append("cuMemcpyHtoDAsync")
        ctypes.memmove(to, source, nbytes)
        return 0

    def cuMemcpy2DAsync_v2(self, copy, stream):  # noqa: N802
        self.calls.append("cuMemcpy2DAsync")
        c = copy._obj
        if c.srcPitch < c.WidthInBytes or c.dstPitch < c.WidthInBytes:
            return self.INVALID_VALUE
        src = ((c.srcHost or 0) if c.srcMemoryType == drv._MEMORY_HOST else c.srcDevice)
        dst = ((c.dstHost or 0) if c.dstMemoryType == drv._MEMORY_HOST else c.dstDevice)
        src += c.srcXInBytes + c.srcY * c.srcPitch
        dst += c.dstXInBytes + c.dstY * c.dstPitch
        for row in range(c.Height):
            ctypes.memmove(dst + row * c.dstPitch, src + row * c.srcPitch, c.WidthInBytes)
        return 0

    def cuStreamCreate(self, stream, flags):  # noqa: N802
        return 0

    def cuEventCreate(self, event, flags):  # noqa: N802
        return 0

    def cuEventRecord(self, event, stream):  # noqa: N802
        return 0

    def cuEventSynchronize(self, event):  # noqa: N802
        return 0

    def cuStreamSynchronize(self, stream):  # noqa: N802
        return 0

    def cuCtxSetCurrent(self, context):  # noqa: N802
        return 0


def fake_driver() -> drv._Driver:
    """A ``_Driver`` over :class:`FakeLibcuda`, its staging arena pinned as the real one is."""
    driver = drv._Driver.__new__(drv._Driver)
    driver.lib = FakeLibcuda()
    driver.context = ctypes.c_void_p()
    driver._arena_used, driver._arena_lock = 0, threading.Lock()
    driver.arena = driver.pinned(drv.ARENA_BYTES)
    return driver
