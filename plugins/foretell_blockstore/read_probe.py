"""Where a block-store read's time goes on this host: ``python -m foretell_blockstore.read_probe``.

Writes one synthetic entry (random bfloat16 KV, default the 4B shape at 4,096 tokens:
36 layers of ``[1, 8, 4096, 128]`` K and V, 604 MB) and reads it back, verified and
unverified taking turns, with the read pool at 1, 2, 4, 8 and 16 threads; then hashes the
same number of bytes in 128 KiB calls (one KV head's rows in a 512-token block: a run) and in
1 MiB calls on 1-8 threads, so it shows whether hashing scales on this host; then reads it
once in each of three fresh processes, showing where a restore's read goes (zero fill,
staging allocations, the read itself, the GPU's first use). Needs no model,
no GPU. Numbers only, never assertions (it measured the 16-core H200 host for
``manifest.block_checksum`` and ``foretell.platform.cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from foretell.platform import blas

RUN_BYTES = 128 << 10


def synthetic_entry(layers: int, tokens: int, heads: int, dim: int, *,
                    make_cache: Callable[[], Any] | None = None,
                    codecs: Sequence[Any] | None = None) -> Any:
    """Random bf16 K and V of ``layers`` layers, ``[1, heads, tokens, dim]`` each, fed to a
    cache from ``make_cache`` (a plain ``KVCache`` by default; a quantized one for
    ``--kv-bits``, with its codec in ``codecs``) and snapshotted as the tier stores it."""
    import mlx.core as mx

    from foretell.cache.codecs import snapshot_entry
    from foretell.model import KVCache

    caches = []
    for layer in range(layers):
        keys = mx.random.normal((1, heads, tokens, dim), key=mx.random.key(layer)).astype(mx.bfloat16)
        cache = make_cache() if make_cache is not None else KVCache()
        cache.update_and_fetch(keys, keys * 2)
        caches.append(cache)
    entry = snapshot_entry(list(range(tokens)), caches, _codecs(codecs))
    # Evaluated here, as the tier hands entries to its writer: a writer thread then runs
    # no MLX op (the writer probes measure what writing costs a decode beside it).
    mx.eval([t for layer in entry.layers for t in layer.tensors.values()])
    return entry


def _codecs(codecs: Sequence[Any] | None) -> list[Any]:
    from foretell.cache.codecs import StandardKVCodec

    return [StandardKVCodec(), *(codecs or [])]


def timed_reads(layout: Any, key: str, workers: int, turns: int, *, gpu: bool
                ) -> dict[str, float]:
    """Median verified and unverified read of ``key`` with the read pool at ``workers``,
    landing on the GPU by DMA (``gpu``) or read straight into the buffers."""
    from foretell.platform import cuda
    from foretell.store import format as fmt

    saved, pool = fmt.io_pool, ThreadPoolExecutor(max_workers=workers, thread_name_prefix="probe")
    fmt.io_pool = lambda: pool  # the layout asks the module for its read pool on each read
    landing = cuda.gpu_landing
    cuda.gpu_landing = lambda: gpu
    try:
        layout.read_layers(key)
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(turns):
            for verify in (False, True):
                start = time.perf_counter()
                layout.read_layers(key, verify=verify)
                runs[verify].append(time.perf_counter() - start)
    finally:
        fmt.io_pool, cuda.gpu_landing = saved, landing
        pool.shutdown()
    return {"unverified_s": statistics.median(runs[False]),
            "verified_s": statistics.median(runs[True])}


def hashing(total: int, threads: int, call_bytes: int) -> float:
    """Seconds for ``threads`` threads to hash ``total`` bytes in ``call_bytes`` calls over
    their own 1 MiB buffer (in the CPU cache, as a run just read is)."""
    per_thread = max(1, total // threads >> 20)

    def work() -> None:
        view = memoryview(bytearray(os.urandom(1 << 20)))
        calls = [view[i : i + call_bytes] for i in range(0, 1 << 20, call_bytes)]
        for _ in range(per_thread):
            for call in calls:
                xxhash.xxh3_64_intdigest(call)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start


def fresh_read(root: str, key: str) -> dict[str, float]:
    """One verified read of ``key`` in this (fresh) process, with where its time went: the
    buffers' zero fill, page-locked staging allocations (on a CUDA GPU), the GPU's first
    pass over the tensors, and the reading, hashing and copying (the rest)."""
    import mlx.core as mx

    from foretell.platform import cuda
    from foretell.tools.bench import timed
    from foretell_blockstore import manifest as mf

    layout = probe_layout(root)
    fills: list[float] = []
    allocations: list[float] = []
    mf.host_buffers = timed(mf.host_buffers, fills)
    cuda.CudaStaging._allocate = timed(cuda.CudaStaging._allocate, allocations)
    mx.eval(mx.zeros(4) + 1)  # the device up, as a restore finds it after the model loads
    start = time.perf_counter()
    layers = layout.read_layers(key)
    spent = {"buffers_s": sum(fills), "staging_alloc_s": sum(allocations),
             "read_s": time.perf_counter() - start}
    start = time.perf_counter()
    mx.eval([a.astype(mx.float32).sum() for layer in layers for a in layer.tensors.values()])
    spent["first_use_s"] = time.perf_counter() - start
    spent["gpu_landing"] = float(cuda.gpu_landing())
    return spent


def probe_layout(root: str, codecs: Sequence[Any] | None = None) -> Any:
    """A block store with default settings under ``root``, serving entries of the plain KV
    codec and ``codecs``."""
    from foretell.store.entry import StoreIdentity
    from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

    identity = StoreIdentity(model_fingerprint="0123456789abcdef", model_id="read-probe",
                             tokenizer_hash="none",
                             codec_providers=[codec.provider_id for codec in _codecs(codecs)])
    return BlockStoreLayout(root, BlockStoreConfig(), identity=identity)


def main(argv: list[str] | None = None) -> None:
    blas.preload()
    if argv is None and sys.argv[1:2] == ["--fresh-read"]:
        print(json.dumps(fresh_read(sys.argv[2], sys.argv[3])))
        return
    parser = argparse.ArgumentParser(prog="python -m foretell_blockstore.read_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args(argv)

    import mlx.core as mx

    from foretell.platform import cuda

    entry = synthetic_entry(args.layers, args.tokens, args.heads, args.dim)
    total = args.layers * 2 * args.heads * args.tokens * args.dim * 2
    with tempfile.TemporaryDirectory(prefix="foretell-read-probe-") as root:
        layout = probe_layout(root)
        start = time.perf_counter()
        layout.write(entry)
        print(f"{total / 1e6:.0f} MB entry written in {time.perf_counter() - start:.2f} s; "
              f"{os.cpu_count()} cores")
        key = layout.key_for(entry.tokens)
        served = layout.read(key)
        same = served is not None and all(
            mx.array_equal(mine, theirs).item()
            for a, b in zip(entry.layers, served.layers)
            for mine, theirs in zip(a.tensors.values(), b.tensors.values()))
        print(f"served exactly what was written: {same}", flush=True)
        for gpu in ((True, False) if cuda.gpu_landing() else (False,)):
            for workers in (1, 2, 4, 8, 16):
                r = timed_reads(layout, key, workers, args.turns, gpu=gpu)
                print(f"{'gpu dma' if gpu else 'direct '} read pool {workers:2d}: unverified "
                      f"{r['unverified_s'] * 1e3:6.1f} ms, verified {r['verified_s'] * 1e3:6.1f} ms"
                      f" ({r['verified_s'] / r['unverified_s']:.2f}x)", flush=True)
        for _ in range(3):
            child = subprocess.run([sys.executable, "-m", "foretell_blockstore.read_probe",
                                    "--fresh-read", root, key], capture_output=True, text=True)
            if child.returncode:
                print("fresh-process read failed:", child.stderr[-1500:], flush=True)
                continue
            phases = json.loads(child.stdout.strip().splitlines()[-1])
            print("fresh-process verified read: " + ", ".join(
                f"{k[:-2]} {v * 1e3:.1f} ms" for k, v in phases.items() if k.endswith("_s"))
                + f" (GPU landing: {bool(phases['gpu_landing'])})", flush=True)
    for call_bytes in (RUN_BYTES, 1 << 20):
        times = "  ".join(f"{n} threads {hashing(total, n, call_bytes) * 1e3:5.1f} ms"
                          for n in (1, 2, 4, 8))
        print(f"hash {total >> 20} MiB in {call_bytes >> 10} KiB calls: {times}", flush=True)


if __name__ == "__main__":
    main()
