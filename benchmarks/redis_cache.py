"""The Redis cold tier (contrib/foretell-redis) against cold prefill and the local block store,
in one run, on the shipped demo model with a local redis-server (not a test).

    python benchmarks/redis_cache.py [--prefix-tokens 4096] [--repeats 5] [--json out.json]

(1) TTFT of a second process on a prefix a first process computed and stored: the prefill
    with no cache, the block store in a local directory (the page cache warm), and the
    ``redis`` layout on the local server; each run in a fresh process (median of
    ``--repeats``), the prompt exactly the stored prefix (one token computed).
(2) Bytes for 8 conversations sharing a 2,048-token system prompt (the workload (a) of
    benchmarks/layouts.py): the single-file layout on disk, the block store on disk, the
    ``redis`` layout's own count and the server's ``used_memory`` growth.
(3) Restore throughput for one entry of the prefix: the layout's verified read in a layout
    that never saw it (its manifest and every block fetched, checked and copied into MLX
    buffers), its unverified read, and the server's own GET throughput for the same bytes
    (the manifest and the blocks fetched by the same client, nothing else done): the limit.

Starts its own redis-server on a free localhost port (Debian: apt-get install redis-server),
imports the plugin from contrib/foretell-redis (or wherever it is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "contrib" / "foretell-redis")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(directory: Path, binary: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    server = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return server, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit(f"{binary} did not start on port {port}")


def _child(args: argparse.Namespace) -> int:
    """One process's request: the prompt in ``--prompt-file``, the cache at ``--location``
    (none, a directory, a redis URL); prints the request's stats as JSON."""
    import foretell

    engine = foretell.load(args.model)
    if args.location:
        from foretell.cache.tier import CacheTier

        layout = None
        if args.location.startswith("redis://"):
            from foretell_redis.layout import RedisLayout

            layout = RedisLayout
        engine.cache = CacheTier.for_engine(engine, args.location,
                                            **({"layout": layout} if layout else {}))
    prompt = json.loads(Path(args.prompt_file).read_text())
    *_, stats = engine.generate(prompt, max_tokens=1, ignore_eos=True)
    if engine.cache is not None:
        engine.cache.close(60)
    print(json.dumps({"ttft_s": stats.ttft_s, "cached_tokens": stats.cached_tokens,
                      "cached_from": stats.cached_from}))
    return 0


def _in_process(prompt_file: Path, model: str, location: str | None) -> dict:
    argv = [sys.executable, __file__, "--child", "--model", model, "--prompt-file",
            str(prompt_file), "--location", location or ""]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "FORETELL_SPILL_DUTY": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ttft(prompt_file: Path, model: str, sides: dict[str, str | None], repeats: int) -> dict:
    """Each side's first process stores the prefix; then fresh processes time their TTFT,
    the sides taking turns (the host is shared)."""
    for location in sides.values():
        if location:
            _in_process(prompt_file, model, location)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, location in sides.items():
            runs[side].append(_in_process(prompt_file, model, location))
    return {side: {"ttft_s": statistics.median(r["ttft_s"] for r in found),
                   "ttft_all_s": [r["ttft_s"] for r in found],
                   "cached_tokens": found[-1]["cached_tokens"],
                   "cached_from": found[-1]["cached_from"]} for side, found in runs.items()}


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "lock")


def _shared_prompt_bytes(model, codecs, identity, vocab: int, url: str, scratch: Path) -> dict:
    import layouts  # benchmarks/layouts.py: the same workload (a)
    import redis

    from foretell.store.single_file import SingleFileLayout
    from foretell_blockstore.layout import BlockStoreLayout
    from foretell_redis.layout import RedisLayout

    entries = layouts._workloads(model, codecs, vocab)[0]["a_shared_prompt"]
    client = redis.Redis.from_url(url)
    client.flushall()
    before = client.info("memory")["used_memory"]
    single = SingleFileLayout(scratch / "single", identity=identity)
    blocks = BlockStoreLayout(scratch / "blocks", identity=identity)
    shared = RedisLayout(url, identity=identity)
    for entry in entries:
        assert single.write(entry) and blocks.write(entry) and shared.write(entry)
    single_bytes = _disk_bytes(scratch / "single")
    grown = client.info("memory")["used_memory"] - before
    return {"conversations": len(entries), "tokens": [len(e.tokens) for e in entries],
            "kv_bytes": sum(e.tensor_bytes for e in entries),
            "single_file_disk_bytes": single_bytes,
            "block_store_disk_bytes": _disk_bytes(scratch / "blocks"),
            "redis_layout_bytes": shared.bytes(), "redis_used_memory_growth": grown,
            "redis_vs_single_file": grown / single_bytes}


def _restore(model, codecs, identity, prompt: list[int], url: str, scratch: Path,
             repeats: int) -> dict:
    import mlx.core as mx
    import redis

    from foretell.cache.codecs import snapshot_entry
    from foretell_blockstore.layout import BlockStoreLayout
    from foretell_redis.layout import RedisLayout

    caches = model.make_caches()
    for start in range(0, len(prompt), 2048):
        model.forward(mx.array([prompt[start:start + 2048]]), caches)
        mx.eval([c.state for c in caches])
    entry = snapshot_entry(prompt, caches, codecs)
    client = redis.Redis.from_url(url)
    client.flushall()
    writer = RedisLayout(url, identity=identity)
    local = BlockStoreLayout(scratch / "restore-blocks", identity=identity)
    assert writer.write(entry) and local.write(entry)
    key = writer.key_for(entry.tokens)
    manifest_key = writer._manifest_key(key)
    block_keys = [writer._block_key(r.id) for r in writer._manifests[key][2].blocks]
    nbytes = len(client.get(manifest_key)) + sum(client.strlen(k) for k in block_keys)
    times: dict[str, list[float]] = {"redis GET of the same bytes": [],
                                     "redis layout, verified": [],
                                     "redis layout, unverified": [],
                                     "block store (local), verified": []}

    def raw_get():
        return client.get(manifest_key), client.mget(block_keys)

    for _ in range(repeats):
        # Layouts that never saw the entry (as in a fresh process), opened before the clock
        # starts: opening is the tier's start-up, not the restore's.
        verified, unverified = (RedisLayout(url, identity=identity) for _ in range(2))
        local_fresh = BlockStoreLayout(scratch / "restore-blocks", identity=identity)
        for layout in (verified, unverified, local_fresh):
            layout.replenish()  # as the tier does when it opens
        for name, read in {
                "redis GET of the same bytes": raw_get,
                "redis layout, verified": lambda r=verified: r.read(key),
                "redis layout, unverified": lambda r=unverified: r.read_layers(
                    key, verify=False),
                "block store (local), verified": lambda r=local_fresh: r.read(
                    local.key_for(entry.tokens))}.items():
            start = time.perf_counter()
            assert read() is not None, name
            times[name].append(time.perf_counter() - start)
    out = {"entry_tokens": len(entry.tokens), "kv_bytes": entry.tensor_bytes,
           "fetched_bytes": nbytes, "rows": {}}
    for name, found in times.items():
        median = statistics.median(found)
        out["rows"][name] = {"s": median, "gb_s": entry.tensor_bytes / median / 1e9,
                             "all_s": found}
    limit = out["rows"]["redis GET of the same bytes"]["s"]
    for row in out["rows"].values():
        row["vs_get"] = limit / row["s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/redis_cache.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--redis-server", default=shutil.which("redis-server")
                        or shutil.which("valkey-server") or "redis-server")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--location", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from foretell.platform import blas

    blas.preload()
    if args.child:
        return _child(args)
    import random

    import mlx.core as mx
    import redis

    from foretell.cache.codecs import RotatingKVCodec, StandardKVCodec
    from foretell.engine import resolve_model_path
    from foretell.model.loading import load
    from foretell.store.entry import StoreIdentity

    model_dir = resolve_model_path(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompt = [rng.randrange(1, vocab) for _ in range(args.prefix_tokens)]
    scratch = Path(tempfile.mkdtemp(prefix="foretell-redisbench-"))
    server, url = _start_server(scratch, args.redis_server)
    try:
        prompt_file = scratch / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        ttft = _ttft(prompt_file, args.model, {
            "cold prefill": None, "block store (local dir)": str(scratch / "kv"),
            "redis (local server)": url}, args.repeats)
        model = load(model_dir)
        codecs = [StandardKVCodec(), RotatingKVCodec()]
        identity = StoreIdentity.for_model_dir(model_dir, model_id=args.model,
                                               codec_providers=[c.provider_id for c in codecs])
        shared = _shared_prompt_bytes(model, codecs, identity, vocab, url, scratch)
        restore = _restore(model, codecs, identity, prompt, url, scratch, args.repeats)
        server_version = redis.Redis.from_url(url).info("server")["redis_version"]
    finally:
        server.terminate()
        server.wait(30)
        shutil.rmtree(scratch, ignore_errors=True)
    import platform

    results = {"machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
               "load_average": os.getloadavg(), "model": args.model, "mlx": mx.__version__,
               "redis_server": server_version, "prefix_tokens": args.prefix_tokens,
               "client": f"redis-py {redis.__version__}"
                         + (" with hiredis" if redis.utils.HIREDIS_AVAILABLE else ""),
               "ttft": ttft, "shared_prompt_bytes": shared, "restore": restore}
    _print(results)
    if args.json:
        from foretell.tools.measure import portable

        Path(args.json).write_text(json.dumps(portable(results), indent=1))
    return 0


def _print(results: dict) -> None:
    out = sys.stdout
    out.write(f"{results['machine']} (load {results['load_average'][0]:.1f}); model "
              f"{results['model']}, mlx {results['mlx']}, redis {results['redis_server']}, "
              f"{results['client']}\n\n")
    cold = results["ttft"]["cold prefill"]["ttft_s"]
    out.write(f"(1) second process, {results['prefix_tokens']}-token prefix: TTFT\n")
    for side, row in results["ttft"].items():
        out.write(f"  {side:<26}{row['ttft_s'] * 1e3:>9.1f} ms  {cold / row['ttft_s']:>6.1f}x "
                  f"cold  (cached {row['cached_tokens']} from {row['cached_from']})\n")
    s = results["shared_prompt_bytes"]
    out.write(f"\n(2) {s['conversations']} conversations sharing a 2,048-token prompt "
              f"({s['kv_bytes'] / 2**20:.1f} MiB of KV)\n")
    for name in ("single_file_disk_bytes", "block_store_disk_bytes", "redis_layout_bytes",
                 "redis_used_memory_growth"):
        out.write(f"  {name:<26}{s[name] / 2**20:>9.1f} MiB  "
                  f"{s[name] / s['single_file_disk_bytes']:>6.2f} of single-file\n")
    r = results["restore"]
    out.write(f"\n(3) restore of one {r['entry_tokens']}-token entry "
              f"({r['kv_bytes'] / 2**20:.1f} MiB of KV)\n")
    for name, row in r["rows"].items():
        out.write(f"  {name:<32}{row['s'] * 1e3:>8.1f} ms  {row['gb_s']:>6.2f} GB/s  "
                  f"{row['vs_get']:>5.2f} of GET\n")


if __name__ == "__main__":
    raise SystemExit(main())
