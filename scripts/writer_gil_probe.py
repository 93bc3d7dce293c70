"""What the block store's writer costs a decode beside it through the GIL alone: the write
pool pinned to CPU 1 keeps writing the 4B shape's 4,096-token entry (36 layers of
[1, 8, 4096, 128] K and V) while a decode-like loop pinned to CPU 0 runs 0.5 ms of Python
and then waits 3 ms without the GIL (a GPU computing a token). Prints one write's time (the
first in this process, then the median of three) and the loop's rate beside the writer
over its rate alone. Linux (sched_setaffinity), two cores or more.

    python scripts/writer_gil_probe.py [KV_BITS]      # 0 (bf16, default), 4 or 8
"""

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from foretell.cache.quantized import QuantizedKVCache, QuantizedKVCodec
from foretell.store import format as fmt
from foretell_blockstore.read_probe import probe_layout, synthetic_entry

WRITER_CPU, LOOP_CPU = 1, 0
background = fmt.background_priority


def pinned_background() -> None:
    os.sched_setaffinity(0, {WRITER_CPU})
    background()


fmt.background_priority = pinned_background  # before the write pool starts its threads
os.sched_setaffinity(0, {LOOP_CPU})

bits = int(sys.argv[1]) if len(sys.argv) > 1 else 0
codecs = [QuantizedKVCodec()]
entry = synthetic_entry(36, 4096, 8, 128, codecs=codecs, make_cache=(
    (lambda: QuantizedKVCache(group_size=64, bits=bits)) if bits else None))
scratch = tempfile.mkdtemp(prefix="foretell-writer-probe-")


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
        busy = time.perf_counter() + 0.0005
        while time.perf_counter() < busy:
            pass
        time.sleep(0.003)
        tokens += 1
    return tokens


try:
    times = [write_once(f"w{i}") for i in range(4)]
    print(f"entry {entry.tensor_bytes / 1e6:.0f} MB: first write {times[0] * 1e3:.0f} ms, "
          f"then {statistics.median(times[1:]) * 1e3:.0f} ms")
    idle = decode_like(2.0)
    stop = threading.Event()

    def keep_writing() -> None:
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
    print(f"decode-like loop beside the writer: {busy / idle:.2f}x idle")
finally:
    shutil.rmtree(scratch, ignore_errors=True)
