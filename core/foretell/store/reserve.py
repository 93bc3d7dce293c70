"""The restore reserve: MLX buffers filled before a restore needs them.

MLX's Python API has no uninitialized allocation (``mx.empty`` is ``mx.zeros``), so a layout
that reads an entry straight into MLX-owned buffers zero-fills them first, and fresh memory
pays its first-touch page faults in that fill, a large share of a restore on a CPU and on a
CUDA GPU alike. A :class:`BufferReserve` pays that fill off the request path (when the tier
opens, and after a request whose restore used it), and a restore carves its buffers from it
(docs/block-store.md, "The restore reserve"; what it buys: docs/decisions.md).

Rules it keeps:

- it holds live arrays, never MLX's buffer cache, so ``mx.clear_cache()`` (the decode loops
  call it) frees nothing it holds;
- ``take`` hands each byte to one restore only: what it carves leaves the reserve for good
  (a failed read drops its buffers; they never come back holding another entry's bytes);
- ``take`` never waits for a fill in progress: without a filled slab that fits it falls back
  (the caller allocates afresh);
- slabs are born where the reads need them: on the GPU for reads that land there by DMA
  (``foretell.platform.cuda``), on a CPU stream otherwise.

Importing this module imports no MLX (``foretell.store`` exports :class:`BufferReserve`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from foretell.errors import ConfigError

#: Megabytes the reserve may hold (0: off); overrides the device's default.
ENV = "FORETELL_RESTORE_RESERVE_MB"
MiB = 1 << 20
#: Default caps. The reserve holds min(cap, the largest stored entry's bytes): memory the
#: restored KV cache would take anyway, held from the tier's opening until a restore uses
#: it. A CPU host shares its RAM with everything; a GPU's memory is the KV cache's.
CPU_DEFAULT_MB = 1024
GPU_DEFAULT_MB = 4096
#: Each carved buffer starts on this boundary (any dtype's alignment, a GPU's 256 bytes).
ALIGN = 256


def parse_megabytes(value: Any, source: str) -> int:
    """Bytes from a cap in megabytes (a number >= 0; 0 turns the reserve off).

    :raises ConfigError: naming ``source`` (the env var or the config field).
    """
    try:
        megabytes = float(value)
    except (TypeError, ValueError):
        megabytes = -1.0
    if isinstance(value, bool) or not megabytes >= 0 or megabytes == float("inf"):
        raise ConfigError(source, [f"{value!r} is not a number of megabytes >= 0 (0: off)"])
    return int(megabytes * MiB)


def env_cap() -> int | None:
    """``FORETELL_RESTORE_RESERVE_MB`` in bytes, None when unset.

    :raises ConfigError: naming the variable when its value is not a number >= 0.
    """
    raw = os.environ.get(ENV)
    return None if raw is None or raw.strip() == "" else parse_megabytes(raw, ENV)


def default_cap(on_gpu: bool) -> int:
    """The cap where nothing sets one: ``FORETELL_RESTORE_RESERVE_MB``, else the device's."""
    forced = env_cap()
    if forced is not None:
        return forced
    return (GPU_DEFAULT_MB if on_gpu else CPU_DEFAULT_MB) * MiB


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class BufferReserve:
    """Already-touched uint8 slabs, carved into one restore's buffers at a time.

    Safe to share between threads. ``refill`` runs MLX (call it where MLX runs, off a
    request's critical path); ``take`` only slices evaluated arrays (views, no copy).
    """

    def __init__(self, max_bytes: int, *, on_gpu: bool = False):
        self.max_bytes = max(0, int(max_bytes))
        self.on_gpu = on_gpu
        self._slabs: list[Any] = []  # evaluated 1-D uint8 arrays, each wholly free
        self._lock = threading.Lock()
        self._filling = False
        #: Restores served from the reserve / that fell back to fresh buffers.
        self.served = 0
        self.missed = 0
        #: Slabs filled, and the seconds those fills took (none of them a restore's).
        self.fills = 0
        self.fill_seconds = 0.0
        self._served_at_fill = 0

    def used_since_fill(self) -> bool:
        """Whether a restore took buffers from it since its last fill (or it was never
        filled): what makes a refill worth its cost."""
        with self._lock:
            return not self.fills or self.served > self._served_at_fill

    def held(self) -> int:
        """Bytes the reserve holds for the next restore."""
        with self._lock:
            return sum(slab.size for slab in self._slabs)

    def take(self, sizes: Sequence[int]) -> list[Any] | None:
        """One 1-D uint8 view per size, carved from the smallest slab that holds them all
        (each starting on :data:`ALIGN`); the slab's rest stays for a later restore. None
        when no slab holds them all (a slab still being filled is not one: no restore waits
        for a fill): the caller allocates afresh. The views' bytes are zeros and are never
        handed out again."""
        import mlx.core as mx

        need = sum(aligned(n) for n in sizes)
        with self._lock:
            fits = [slab for slab in self._slabs if slab.size >= need]
            if not fits or need == 0:
                self.missed += 1
                return None
            slab = min(fits, key=lambda s: s.size)
            self._slabs.remove(slab)
            rest = slab[need:] if slab.size - need >= ALIGN else None
            if rest is not None:
                self._slabs.append(rest)
            self.served += 1
        views, offset = [], 0
        for n in sizes:
            views.append(slab[offset:offset + n])
            offset += aligned(n)
        # Slicing an evaluated contiguous array is a view of its buffer (no copy, no fill).
        mx.eval(views, *([rest] if rest is not None else []))
        return views

    def refill(self, nbytes: int) -> float:
        """Hold a slab of at least ``min(nbytes, max_bytes)`` bytes, filling one if none
        does; a new slab replaces the rests earlier restores left (the reserve holds one
        entry's worth, not a pile of rests). Returns the seconds spent filling (0.0 when
        nothing was needed, or another thread is filling)."""
        import mlx.core as mx

        target = aligned(min(int(nbytes), self.max_bytes)) if nbytes > 0 else 0
        with self._lock:
            if target == 0 or self._filling or any(s.size >= target for s in self._slabs):
                return 0.0
            self._filling = True
        try:
            start = time.perf_counter()
            stream = mx.gpu if self.on_gpu else mx.cpu
            slab = mx.zeros((target,), dtype=mx.uint8, stream=stream)
            mx.eval(slab)  # touches every page now, so a restore's read page-faults on none
            if self.on_gpu:
                # MLX-CUDA gives a host address (a memoryview, where the read's copies land)
                # for a buffer born in device memory only after moving the buffer to managed
                # memory, a copy of all of it: paid here, not by the restore's first view.
                memoryview(slab)
            seconds = time.perf_counter() - start
        finally:
            with self._lock:
                self._filling = False
        with self._lock:
            # A dropped rest's memory goes back once the restore that took its slab's head
            # is freed (MLX frees a buffer when its last view goes).
            self._slabs = [slab]
            self._served_at_fill = self.served
            self.fills += 1
            self.fill_seconds += seconds
        return seconds

    def clear(self) -> None:
        """Let go of every slab (their memory returns to MLX once no restore uses it)."""
        with self._lock:
            self._slabs.clear()

    def stats(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes, "held_bytes": self.held(), "served": self.served,
                "missed": self.missed, "fills": self.fills, "fill_s": self.fill_seconds,
                "on_gpu": self.on_gpu}
