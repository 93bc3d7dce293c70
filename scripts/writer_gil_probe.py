"""What the block store's writer costs a decode beside it through the GIL alone: the write
pool pinned to CPU 1 keeps writing the 4B shape's 4,096-token entry (36 layers of
[1, 8, 4096, 128] K and V) while a decode-like loop pinned to CPU 0 runs BUSY ms of Python
and then waits WAIT ms without the GIL (a GPU computing a token; default 0.5 and 3, a
launch-bound decode is more like 8 and 1). Prints one write's time (the first in this
process, then the median of three) and, for three rounds, the loop's rate beside the
writer over its rate alone just before. Linux (sched_setaffinity), two cores or more.

On a CUDA GPU the writes go by DMA (``foretell.platform.cuda.write_area``), as the store's
do. ``--dma-standin`` runs that path's Python on a host without one: a stand-in driver
(compiled with ``cc``) whose 2D copy is a C loop on the writer's core, so the block store
calls ``CudaStaging.fetch`` and ``PinnedArea`` exactly as on the GPU.

    python scripts/writer_gil_probe.py [KV_BITS] [--loop BUSY,WAIT] [--dma-standin]
"""

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

from foretell.cache.quantized import QuantizedKVCache, QuantizedKVCodec
from foretell.platform import cuda
from foretell.store import format as fmt
from foretell_blockstore.read_probe import probe_layout, synthetic_entry

WRITER_CPU, LOOP_CPU = 1, 0
ROUNDS = 3

# The driver calls the write path makes, as no-ops but for the copy (CUDA_MEMCPY2D's layout:
# memory types 1 host, 4 unified).
STANDIN_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
typedef struct { size_t sx, sy; int st; const char* sh; unsigned long long sd; void* sa;
                 size_t sp, dx, dy; int dt; char* dh; unsigned long long dd; void* da;
                 size_t dp, width, height; } M2D;
int cuMemcpy2DAsync_v2(const M2D* c, void* s) {
  const char* src = c->st == 1 ? c->sh : (const char*)c->sd;
  char* dst = c->dt == 1 ? c->dh : (char*)c->dd;
  for (size_t r = 0; r < c->height; r++) memcpy(dst + r * c->dp, src + r * c->sp, c->width);
  return 0; }
int cuStreamSynchronize(void* s) { return 0; }
int cuEventSynchronize(void* e) { return 0; }
int cuEventRecord(void* e, void* s) { return 0; }
int cuStreamCreate(void** s, unsigned f) { *s = (void*)1; return 0; }
int cuEventCreate(void** e, unsigned f) { *e = (void*)1; return 0; }
int cuCtxSetCurrent(void* c) { return 0; }
int cuMemHostAlloc(void** p, size_t n, unsigned f) {
  *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096); return *p ? 0 : 2; }
int cuMemFreeHost(void* p) { free(p); return 0; }
"""


def use_dma_standin(scratch: str) -> None:
    """Route the block store's writes through ``CudaStaging`` and a ``PinnedArea`` over the
    stand-in driver (the argument types as ``cuda._Driver`` sets them)."""
    source, library = os.path.join(scratch, "standin.c"), os.path.join(scratch, "standin.so")
    with open(source, "w") as f:
        f.write(STANDIN_SOURCE)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", library, source], check=True)
    driver = object.__new__(cuda._Driver)
    driver.lib, driver.context = ctypes.CDLL(library), ctypes.c_void_p(1)
    driver.lib.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(cuda._Memcpy2D), ctypes.c_void_p]
    driver.lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                          ctypes.c_uint]
    for name in ("cuStreamSynchronize", "cuEventSynchronize", "cuMemFreeHost", "cuCtxSetCurrent"):
        getattr(driver.lib, name).argtypes = [ctypes.c_void_p]
    driver.lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    area, local = cuda.PinnedArea(driver), threading.local()

    def staging() -> cuda.Staging:
        if not hasattr(local, "staging"):
            local.staging = cuda.CudaStaging(driver)
        return local.staging

    cuda.write_area, cuda.staging = (lambda: area), staging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kv_bits", nargs="?", type=int, default=0, choices=(0, 4, 8))
    parser.add_argument("--loop", default="0.5,3", metavar="BUSY,WAIT")
    parser.add_argument("--dma-standin", action="store_true")
    args = parser.parse_args()
    busy_s, wait_s = (float(ms) / 1e3 for ms in args.loop.split(","))

    background = fmt.background_priority

    def pinned_background() -> None:
        os.sched_setaffinity(0, {WRITER_CPU})
        background()

    fmt.background_priority = pinned_background  # before the write pool starts its threads
    os.sched_setaffinity(0, {LOOP_CPU})
    scratch = tempfile.mkdtemp(prefix="foretell-writer-probe-")
    if args.dma_standin:
        use_dma_standin(scratch)
    codecs = [QuantizedKVCodec()]
    bits = args.kv_bits
    entry = synthetic_entry(36, 4096, 8, 128, codecs=codecs, make_cache=(
        (lambda: QuantizedKVCache(group_size=64, bits=bits)) if bits else None))

    def write_once(name: str) -> float:
        root = os.path.join(scratch, name)
        start = time.perf_counter()
        probe_layout(root, codecs).write(entry)
        took = time.perf_counter() - start
        shutil.rmtree(root, ignore_errors=True)
        return took

    def decode_like(seconds: float) -> int:
        tokens, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            busy = time.perf_counter() + busy_s
            while time.perf_counter() < busy:
                pass
            time.sleep(wait_s)
            tokens += 1
        return tokens

    try:
        times = [write_once(f"w{i}") for i in range(4)]
        path = "by DMA" if cuda.write_area() is not None else "on the CPU"
        print(f"entry {entry.tensor_bytes / 1e6:.0f} MB, gathered {path}: first write "
              f"{times[0] * 1e3:.0f} ms, then {statistics.median(times[1:]) * 1e3:.0f} ms")
        ratios = []
        for _ in range(ROUNDS):
            idle = decode_like(2.0)
            stop = threading.Event()

            def keep_writing(stop: threading.Event = stop) -> None:
                os.sched_setaffinity(0, {WRITER_CPU})
                turn = 0
                while not stop.is_set():
                    write_once(f"bg{turn}")
                    turn += 1

            writer = threading.Thread(target=keep_writing)
            writer.start()
            time.sleep(0.1)
            busy = decode_like(2.0)
            stop.set()
            writer.join()
            ratios.append(busy / idle)
        print(f"decode-like loop ({args.loop} ms) beside the writer: "
              + ", ".join(f"{r:.3f}x" for r in ratios) + " idle")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
