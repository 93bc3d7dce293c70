"""Where a GPU-landing restore read's bandwidth goes on a CUDA host: the page-cache reads
into page-locked slots alone, the DMA copies alone, and both as the block store does them.

    python scripts/dma_split.py [MB] [THREADS...]     # default 604 MB, 4 8 16 threads

Writes one file of MB random bytes (page cache warm), allocates one MLX buffer of that size
on the GPU and takes its host address (as the restore reserve does), then per thread count,
5 turns each, median: ``read`` preads 1 MiB pieces into each thread's staging slots,
``dma`` sends the slots' (stale) bytes to the buffer as 8 runs of 128 KiB, strided as a
block's KV heads are, with no read, and ``both`` does what a read does (read, send, hash).
Then, on 8 threads, ``both`` with the copies on fewer streams shared by the readers (one per
reader today) and with more staging slots per reader (two today: a reader waits on the copy
of the piece before last); then, per thread count, reads of several pieces at once, hashed
or not, copied into place or whole into device memory (``grouped``). Numbers only, never assertions (docs/block-store.md). Without a CUDA driver, "dma" is the
host copy the reference staging makes.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

PIECE = 1 << 20
RUNS = 8


def main() -> None:
    import mlx.core as mx
    import xxhash

    from foretell.platform import cuda

    mb = int(sys.argv[1]) if len(sys.argv) > 1 else 604
    threads = [int(a) for a in sys.argv[2:]] or [4, 8, 16]
    on_gpu = cuda.gpu_landing()  # elsewhere "dma" is the host copy a Staging makes
    pieces = mb * (1 << 20) // PIECE
    with tempfile.NamedTemporaryFile(prefix="dma-split-") as file:
        for _ in range(pieces):
            file.write(os.urandom(PIECE))
        file.flush()
        with open(file.name, "rb") as warm:
            while warm.read(64 << 20):
                pass
        buffer = mx.zeros((pieces * PIECE,), dtype=mx.uint8, stream=mx.gpu if on_gpu else mx.cpu)
        mx.eval(buffer)
        flat = memoryview(buffer).cast("B")  # the host address: MLX moves it to managed memory
        run = PIECE // RUNS
        # The buffer as [RUNS, pieces, run]: a piece's runs lie a RUNS-th of it apart, as a
        # block's rows of each KV head do in a tensor.
        stride = pieces * run

        def destinations(index: int) -> list[memoryview]:
            base = index * run
            return [flat[base + r * stride: base + r * stride + run] for r in range(RUNS)]

        local, lock, shared = threading.local(), threading.Lock(), {}

        def staging(streams: int, slots: int):
            """This thread's staging with ``slots`` slots, copying on one of ``streams``
            streams shared by the readers (0: its own, as the block store does)."""
            stages = local.__dict__.setdefault("stages", {})
            if (streams, slots) not in stages:
                if not on_gpu:
                    stage = type("Slots", (cuda.Staging,), {"SLOTS": slots})()
                else:
                    stage = type("Slots", (cuda.CudaStaging,), {"SLOTS": slots})(cuda._DRIVER[0])
                    with lock:
                        taken = shared.setdefault((streams, slots), [])
                        taken.append(stage._stream)
                        if streams:
                            stage._stream = taken[(len(taken) - 1) % streams]
                stages[streams, slots] = stage
            return stages[streams, slots]

        def work(mode: str, chunk: range, streams: int = 0, slots: int = 2) -> None:
            stage = staging(streams, slots)
            fd = os.open(file.name, os.O_RDONLY)
            try:
                for index in chunk:
                    slot = stage.slot(PIECE)
                    if mode != "dma":
                        os.preadv(fd, [slot], index * PIECE)
                    if mode != "read":
                        stage.send(slot, destinations(index))
                    if mode == "both":
                        xxhash.xxh3_64_intdigest(slot)
            finally:
                stage.finish()
                os.close(fd)

        for count in threads:
            pool = ThreadPoolExecutor(count)
            per = -(-pieces // count)
            chunks = [range(i, min(i + per, pieces)) for i in range(0, pieces, per)]
            line = []
            for mode in ("read", "dma", "both"):
                turns = []
                for _ in range(5):
                    start = time.perf_counter()
                    list(pool.map(lambda c, m=mode: work(m, c), chunks))
                    turns.append(time.perf_counter() - start)
                took = statistics.median(turns)
                line.append(f"{mode} {took * 1e3:6.1f} ms ({pieces * PIECE / took / 1e9:5.1f} GB/s)")
            print(f"{count:2d} threads: " + ", ".join(line), flush=True)
            pool.shutdown()
        pool = ThreadPoolExecutor(8)
        per = -(-pieces // 8)
        chunks = [range(i, min(i + per, pieces)) for i in range(0, pieces, per)]
        for streams in (0, 1, 2, 4):
            line = []
            for slots in (2, 4):
                turns = []
                for _ in range(5):
                    start = time.perf_counter()
                    list(pool.map(lambda c, n=streams, k=slots: work("both", c, n, k), chunks))
                    turns.append(time.perf_counter() - start)
                took = statistics.median(turns)
                line.append(f"{slots} slots {took * 1e3:6.1f} ms ({pieces * PIECE / took / 1e9:5.1f} GB/s)")
            print(f" 8 threads, both, copies on {streams or 'own'} streams: " + ", ".join(line),
                  flush=True)
        pool.shutdown()
        for count in threads:
            grouped(file.name, pieces, destinations, on_gpu, count)


def grouped(path: str, pieces: int, destinations, on_gpu: bool, readers: int) -> None:
    """``readers`` threads, reads of ``group`` pieces at once (one ``preadv`` of group MiB,
    then each piece's copy and hash), with and without the hash; and the same reads copied
    whole into device memory (``cuMemAlloc``, one 1-D copy per read): whether per-piece calls
    or the managed, strided destination bound a read."""
    import ctypes

    import xxhash

    from foretell.platform import cuda

    driver = cuda._DRIVER[0] if on_gpu else None
    device = ctypes.c_uint64()
    if driver is not None:
        driver.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        driver.check(driver.lib.cuMemAlloc_v2(ctypes.byref(device), pieces * PIECE), "cuMemAlloc")
    local = threading.local()
    pool = ThreadPoolExecutor(readers)
    per = -(-pieces // readers)
    chunks = [range(i, min(i + per, pieces)) for i in range(0, pieces, per)]

    def work(chunk: range, group: int, hashed: bool, target: str) -> None:
        stages = local.__dict__.setdefault("stages", {})
        if group not in stages:
            stages[group] = cuda.CudaStaging(driver) if driver else cuda.Staging()
        stage = stages[group]
        fd = os.open(path, os.O_RDONLY)
        try:
            for first in range(chunk.start, chunk.stop, group):
                count = min(group, chunk.stop - first)
                slot = stage.slot(count * PIECE)
                os.preadv(fd, [slot], first * PIECE)
                if target == "device" and driver is not None:
                    index = (stage._turn - 1) % stage.SLOTS
                    driver.check(driver.lib.cuMemcpyHtoDAsync_v2(
                        device.value + first * PIECE, cuda._address(slot), count * PIECE,
                        stage._stream), "cuMemcpyHtoDAsync")
                    driver.check(driver.lib.cuEventRecord(stage._events[index], stage._stream),
                                 "cuEventRecord")
                    stage._sent[index] = True
                else:
                    for j in range(count):
                        stage.send(slot[j * PIECE:(j + 1) * PIECE], destinations(first + j))
                if hashed:
                    for j in range(count):
                        xxhash.xxh3_64_intdigest(slot[j * PIECE:(j + 1) * PIECE])
        finally:
            stage.finish()
            os.close(fd)

    for target in ("managed", "device") if driver else ("managed",):
        for hashed in (True, False):
            line = []
            for group in (1, 2, 4, 8):
                turns = []
                for _ in range(5):
                    start = time.perf_counter()
                    list(pool.map(lambda c, g=group, h=hashed, t=target: work(c, g, h, t), chunks))
                    turns.append(time.perf_counter() - start)
                took = statistics.median(turns)
                line.append(f"{group} MiB {took * 1e3:5.1f} ms ({pieces * PIECE / took / 1e9:4.1f} GB/s)")
            print(f"{readers:2d} threads, reads of G MiB into {target}{'' if hashed else ', no hash'}: "
                  + ", ".join(line), flush=True)
    pool.shutdown()


if __name__ == "__main__":
    main()
