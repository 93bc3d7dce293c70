"""Where a restore's time goes on this machine (not a test; numbers for docs/benchmarks.md).

    python -m foretell.cache.restore_probe [--layers 36] [--tokens 4096] [--json FILE]

Writes one safetensors file shaped like a KV entry (``layers`` × keys and values of
``[1, 8, tokens, 128]`` bfloat16: the 4B shape is 604 MB at 4,096 tokens) under ``TMPDIR``,
then, from the page cache and with medians of three:

- ``dd``: the whole file read into one host buffer (the bandwidth to compare with);
- ``mlx_load_sequential``: MLX's loader, one tensor evaluated at a time (today's read);
- ``mlx_load_all``: the same loader, every tensor evaluated at once;
- ``pread_threads``: tensors read by a thread pool into host buffers, then adopted;
- each followed by ``first_use``: one GPU reduction over every tensor (what the first
  decode step pays if the arrays are not yet where the device reads them);
- checksum throughput over the same bytes, one thread and a pool: CRC-32 (zlib) and, if
  installed, XXH3-64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def _median_s(fn: Callable[[], Any], repeats: int = 3) -> float:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m foretell.cache.restore_probe")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import mlx.core as mx
    import numpy as np

    shape = (1, 8, args.tokens, 128)
    names = [f"{i}.{kv}" for i in range(args.layers) for kv in ("keys", "values")]
    path = os.path.join(tempfile.mkdtemp(prefix="foretell-restore-probe-"), "entry.safetensors")
    mx.save_safetensors(path, {n: mx.random.normal(shape).astype(mx.bfloat16) for n in names})
    size = os.path.getsize(path)
    with open(path, "rb") as fh:  # the safetensors index: where each tensor's bytes lie
        header_len = int.from_bytes(fh.read(8), "little")
        index = json.loads(fh.read(header_len))
    start_of_data = 8 + header_len
    spans = {n: (start_of_data + index[n]["data_offsets"][0],
                 index[n]["data_offsets"][1] - index[n]["data_offsets"][0]) for n in names}
    pool = ThreadPoolExecutor(max_workers=args.threads)
    report: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__,
                              "bytes": size, "tensors": len(names), "threads": args.threads}

    def gb_s(seconds: float) -> dict[str, float]:
        return {"s": seconds, "gb_per_s": size / seconds / 1e9}

    def dd() -> None:
        buf = bytearray(size)
        with open(path, "rb", buffering=0) as fh:
            fh.readinto(buf)

    dd()  # warm the page cache
    report["dd"] = gb_s(_median_s(dd))

    def first_use(arrays: list[Any]) -> None:
        mx.eval([a.astype(mx.float32).sum() for a in arrays])

    def with_first_use(load: Callable[[], list[Any]]) -> dict[str, Any]:
        reads, uses = [], []
        for _ in range(3):
            start = time.perf_counter()
            arrays = load()
            mid = time.perf_counter()
            first_use(arrays)
            reads.append(mid - start)
            uses.append(time.perf_counter() - mid)
            del arrays
        return {**gb_s(statistics.median(reads)), "first_use_s": statistics.median(uses)}

    def mlx_sequential() -> list[Any]:
        loaded = mx.load(path, format="safetensors", stream=mx.cpu)
        out = []
        for n in names:
            mx.eval(loaded[n])
            out.append(loaded[n])
        return out

    def mlx_all() -> list[Any]:
        loaded = mx.load(path, format="safetensors", stream=mx.cpu)
        arrays = [loaded[n] for n in names]
        mx.eval(arrays)
        return arrays

    def read_one(name: str) -> Any:
        offset, length = spans[name]
        buf = np.empty(length, dtype=np.uint8)
        with open(path, "rb", buffering=0) as fh:
            fh.seek(offset)
            fh.readinto(memoryview(buf))
        return buf

    def pread_threads() -> list[Any]:
        bufs = list(pool.map(read_one, names))
        return [mx.array(b.view(np.uint16).reshape(shape)).view(mx.bfloat16) for b in bufs]

    def pread_threads_host_only() -> list[Any]:
        return list(pool.map(read_one, names))

    report["mlx_load_sequential"] = with_first_use(mlx_sequential)
    report["mlx_load_all"] = with_first_use(mlx_all)
    report["pread_threads"] = with_first_use(pread_threads)
    report["pread_threads_host_only"] = gb_s(_median_s(pread_threads_host_only))

    blobs = pread_threads_host_only()
    hashes: dict[str, Callable[[Any], Any]] = {"crc32_zlib": zlib.crc32}
    try:
        import xxhash

        hashes["xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        report["xxh3_64"] = "not installed"
    for hname, fn in hashes.items():
        report[f"{hname}_one_thread"] = gb_s(_median_s(lambda f=fn: [f(b) for b in blobs]))
        report[f"{hname}_pool"] = gb_s(_median_s(lambda f=fn: list(pool.map(f, blobs))))
    os.remove(path)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
