"""What a CPU read of a GPU array costs the GPU's next pass over it (MLX's CUDA build keeps
arrays in managed memory): does reading an entry's bytes on the host, as the spill writer
does, move its pages off the GPU? Against that, a DMA copy of the same bytes to pinned host
memory (``cuMemcpyDtoH``). Run on a CUDA host: ``python scripts/managed_read_probe.py [MB]``.
Prints milliseconds per step, medians of ROUNDS (default 5) fresh arrays."""

from __future__ import annotations

import ctypes
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from foretell.platform import cuda


def gpu_pass(a: mx.array) -> float:
    t = time.perf_counter()
    mx.eval((a ^ 1).sum())
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    megabytes = int(sys.argv[1]) if len(sys.argv) > 1 else 604
    rounds = 5
    words = megabytes * (1 << 20) // 4
    assert cuda.gpu_landing(), "needs MLX on a CUDA GPU"
    driver = cuda._DRIVER[0]
    driver.lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    pinned = driver.pinned(words * 4)
    steps: dict[str, list[float]] = {}

    def note(name: str, ms: float) -> None:
        steps.setdefault(name, []).append(ms)

    for _ in range(rounds):
        for how in ("cpu", "dma"):
            a = mx.arange(words, dtype=mx.uint32, stream=mx.gpu)
            mx.eval(a)
            gpu_pass(a)
            note("gpu pass, warm", gpu_pass(a))
            view = memoryview(a).cast("B")
            t = time.perf_counter()
            if how == "cpu":
                host = np.frombuffer(view, dtype=np.uint8)
                copied = np.array(host)  # what hashing and writing a view read, once
            else:
                driver.check(driver.lib.cuMemcpyDtoH_v2(ctypes.addressof(pinned),
                                                        cuda.address(view), words * 4),
                             "cuMemcpyDtoH")
                copied = np.frombuffer(pinned, dtype=np.uint8)
            note(f"{how}: read to host", (time.perf_counter() - t) * 1e3)
            assert copied[4] == 1
            note(f"{how}: gpu pass after", gpu_pass(a))
            note(f"{how}: gpu pass again", gpu_pass(a))
            del a, copied, view
    print(f"{megabytes} MB, medians of {rounds}:")
    for name, values in steps.items():
        print(f"  {name:28s} {statistics.median(values):8.1f} ms   "
              f"({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
