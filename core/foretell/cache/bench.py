"""The cache benchmark (``foretell bench --cache``): what the prefix cache buys and costs.

For each model, in one run:

- time to first token for a long prompt (default 4,096 tokens): cold prefill, a RAM hit,
  and an SSD restore in a fresh process, with the page cache warm and with the entry's
  pages evicted (``posix_fadvise(DONTNEED)``, no root needed);
- restore bandwidth beside ``dd``'s sequential read of the same file;
- mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` on the same prompt's KV;
- verified vs unverified reads of the entry (every checksum vs none);
- decode tok/s with nothing else running vs while a background thread keeps writing the
  entry, as the spill worker would.

Each phase runs in its own process (``python -m foretell.cache.bench --worker PHASE``), so
"fresh process" means it. Not a test: numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_PROMPT_TOKENS = 4096


# -- helpers both sides use -----------------------------------------------------------------


def evict(paths: Sequence[Path]) -> None:
    """Drop the files' clean pages from the page cache, so the next read goes to the disk."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        finally:
            os.close(fd)


def entry_files(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("*/*.safetensors"), key=lambda p: p.stat().st_size)


def dd_read(path: Path, *, cold: bool) -> dict[str, float]:
    """``dd``'s sequential read of ``path`` (16 MiB blocks) to /dev/null."""
    if cold:
        evict([path])
    start = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M"], check=True,
                   capture_output=True)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "gb_per_s": path.stat().st_size / seconds / 1e9}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _generate(engine: Any, prompt: list[int], max_tokens: int = 1) -> Any:
    return list(engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True))[-1]


# -- the worker phases ------------------------------------------------------------------------


def phase_prime(model: Path, directory: Path, prompt: list[int], args: argparse.Namespace
                ) -> dict[str, Any]:
    """Cold prefill, RAM hits, storing, verified reads, mlx-lm's files, decode under writes."""
    import mlx.core as mx

    import foretell
    from foretell.cache.tier import CacheTier
    from foretell.store.single_file import SingleFileLayout

    engine = foretell.load(model)
    _generate(engine, prompt[:64], 4)  # warm-up: first-call costs are nobody's TTFT
    if mx.default_device() != mx.cpu:
        # A GPU compiles kernels per shape on first use (47 s once on the H200): a cold
        # prefill that paid for that would flatter the cache.
        _generate(engine, prompt)
    out: dict[str, Any] = {}
    out["cold_ttft_s"] = _generate(engine, prompt).ttft_s
    tier = CacheTier.for_engine(engine, directory, layout=SingleFileLayout)  # one file: dd's
    engine.cache = tier
    out["cold_ttft_with_store_s"] = _generate(engine, prompt).ttft_s
    hits = [_generate(engine, prompt) for _ in range(args.repeats)]
    out["ram_hit_ttft_s"] = _median([h.ttft_s for h in hits])
    out["ram_hit_cached_tokens"] = hits[-1].cached_tokens
    start = time.perf_counter()
    report = tier.flush(600)
    out["flush_s"] = time.perf_counter() - start
    out["durable"] = report.durable
    donor = max(tier.ram.entries(), key=lambda e: len(e.tokens))
    path = entry_files(directory)[-1]
    out["entry_bytes"] = path.stat().st_size
    out["reads"] = _verified_reads(tier, path, args.repeats)
    out["mlx_lm"] = _mlx_lm_files(donor.caches, directory.parent / "mlx-lm", args.repeats)
    engine.cache = None
    out["decode"] = _decode_under_writes(engine, tier, donor, directory.parent / "scratch", args)
    tier.close(60)
    return out


def _verified_reads(tier: Any, path: Path, repeats: int) -> dict[str, Any]:
    from foretell.store import format as fmt

    identity = tier.ssd.layout.identity

    def read(verify: bool) -> float:
        start = time.perf_counter()
        with open(path, "rb") as fh:
            header = fmt.read_header(fh, os.fstat(fh.fileno()).st_size, identity)
            fmt.read_layers(fh, header, verify=verify)
        return time.perf_counter() - start

    read(True)
    runs: dict[str, list[float]] = {"verified": [], "unverified": []}
    for _ in range(max(3, repeats)):  # alternating, so drift on a shared host hits both
        runs["unverified"].append(read(False))
        runs["verified"].append(read(True))
    verified, unverified = _median(runs["verified"]), _median(runs["unverified"])
    return {"verified_s": verified, "unverified_s": unverified,
            "ratio": verified / unverified, "runs": runs, "checksum": fmt.CHECKSUM}


def _mlx_lm_files(caches: list[Any], directory: Path, repeats: int) -> dict[str, Any] | None:
    """mlx-lm's prompt-cache file of the same KV: save, then load warm and evicted."""
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

        from foretell.model.kvcache import KVCache as OurKV
    except ImportError:
        return None
    if not all(type(c) is OurKV for c in caches):
        return {"skipped": "mlx-lm rows need plain KV caches (a sliding-window model here)"}
    theirs = []
    for cache in caches:
        lm = KVCache()
        lm.keys, lm.values = (mx.array(a) for a in cache.state)
        lm.offset = cache.offset
        theirs.append(lm)
    mx.eval([(c.keys, c.values) for c in theirs])
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "prompt.safetensors"
    saves, warm, cold = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        save_prompt_cache(str(path), theirs)
        saves.append(time.perf_counter() - start)
        for target, evicted in ((cold, True), (warm, False)):
            if evicted:
                evict([path])
            start = time.perf_counter()
            loaded = load_prompt_cache(str(path))
            mx.eval([(c.keys, c.values) for c in loaded])
            target.append(time.perf_counter() - start)
    return {"save_s": _median(saves), "load_warm_s": _median(warm), "load_evicted_s": _median(cold),
            "bytes": path.stat().st_size, "fsync": False, "checksums": False}


def _decode_under_writes(engine: Any, tier: Any, donor: Any, scratch: Path,
                         args: argparse.Namespace) -> dict[str, Any]:
    from foretell.cache.codecs import snapshot_entry
    from foretell.store.single_file import SingleFileLayout

    entry = snapshot_entry(donor.tokens, donor.caches, tier.codecs)
    layout = SingleFileLayout(scratch, identity=tier.ssd.layout.identity)
    short = list(donor.tokens[:32])
    speeds: dict[str, list[float]] = {"idle": [], "writing": []}
    written = []
    for i in range(2 * args.repeats):
        # Alternating order (idle, writing / writing, idle), so drift hits both alike.
        if (i % 2 == 0) == (i % 4 < 2):
            speeds["idle"].append(_generate(engine, short, args.decode_tokens).generation_tps)
            continue
        stop = threading.Event()
        count = [0]
        writer = threading.Thread(target=_write_until, args=(layout, entry, stop, count),
                                  daemon=True)
        writer.start()
        speeds["writing"].append(_generate(engine, short, args.decode_tokens).generation_tps)
        stop.set()
        writer.join()
        written.append(count[0])
    idle, writing = _median(speeds["idle"]), _median(speeds["writing"])
    return {"idle_tps": idle, "writing_tps": writing, "ratio": writing / idle,
            "entries_written_per_run": written, "entry_bytes": entry.tensor_bytes,
            "runs": speeds}


def _write_until(layout: Any, entry: Any, stop: threading.Event, count: list[int]) -> None:
    """Rewrite ``entry`` until told to stop: a spill worker that never runs dry."""
    while not stop.is_set():
        layout.write(entry)
        count[0] += 1


def phase_restore(model: Path, directory: Path, prompt: list[int], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """A fresh process: open the tier over what ``prime`` stored, restore, first token."""
    import foretell
    from foretell.cache.tier import CacheTier
    from foretell.store.single_file import SingleFileLayout

    start = time.perf_counter()
    engine = foretell.load(model)
    loaded_s = time.perf_counter() - start
    _generate(engine, prompt[-64:][:8] if len(prompt) > 8 else prompt, 2)  # warm-up, uncached
    if args.evict:
        evict(entry_files(directory))
    start = time.perf_counter()
    tier = CacheTier.for_engine(engine, directory, layout=SingleFileLayout)
    scan_s = time.perf_counter() - start
    reads: list[float] = []
    real_read = tier.ssd.read

    def timed_read(stored: Any) -> Any:
        begin = time.perf_counter()
        entry = real_read(stored)
        reads.append(time.perf_counter() - begin)
        return entry

    tier.ssd.read = timed_read
    engine.cache = tier
    stats = _generate(engine, prompt)
    restore_s = sum(reads)
    path = entry_files(directory)[-1]
    return {"ttft_s": stats.ttft_s, "cached_tokens": stats.cached_tokens,
            "cached_from": stats.cached_from, "model_load_s": loaded_s, "scan_s": scan_s,
            "read_s": restore_s, "read_gb_per_s": path.stat().st_size / restore_s / 1e9
            if restore_s else None, "evicted": args.evict}


PHASES: dict[str, Callable[..., dict[str, Any]]] = {"prime": phase_prime,
                                                     "restore": phase_restore}


def _worker(argv: Sequence[str]) -> int:
    from foretell.platform import blas

    blas.preload()  # before mlx is imported (docs/blas.md)
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=sorted(PHASES))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--prompt", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--evict", action="store_true")
    args = parser.parse_args(argv)
    prompt = json.loads(args.prompt.read_text())
    result = PHASES[args.phase](args.model, args.dir, prompt, args)
    print("FORETELL-CACHE-BENCH " + json.dumps(result), flush=True)
    return 0


def _run_phase(phase: str, model: Path, directory: Path, prompt_file: Path, *extra: str
               ) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "foretell.cache.bench", "--worker", phase, "--model", str(model),
         "--dir", str(directory), "--prompt", str(prompt_file), *extra],
        capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("FORETELL-CACHE-BENCH "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"cache bench phase '{phase}' failed (exit {done.returncode}):\n"
                       f"{done.stderr[-3000:]}")


# -- the whole run ----------------------------------------------------------------------------


def run_cache_bench(models: Sequence[tuple[str, Path]], *, prompt_tokens: int, repeats: int,
                    decode_tokens: int, work_dir: Path | None = None,
                    progress: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    from foretell.tools.bench import machine_info, prompt_ids

    rows = []
    for name, model in models:
        scratch = Path(tempfile.mkdtemp(prefix="foretell-cache-bench-", dir=work_dir))
        try:
            directory = scratch / "cache"
            prompt_file = scratch / "prompt.json"
            prompt_file.write_text(json.dumps(prompt_ids(model, prompt_tokens)))
            common = ["--repeats", str(repeats), "--decode-tokens", str(decode_tokens)]
            progress(f"{name}: cold prefill, RAM hits, store, reads, mlx-lm files, decode")
            row: dict[str, Any] = {"model": name, "prompt_tokens": prompt_tokens}
            row["prime"] = _run_phase("prime", model, directory, prompt_file, *common)
            progress(f"{name}: SSD restore in fresh processes (page cache warm, then evicted)")
            runs: dict[str, list[dict[str, Any]]] = {"warm": [], "evicted": []}
            for _ in range(repeats):  # alternating, each in a fresh process
                runs["warm"].append(_run_phase("restore", model, directory, prompt_file, *common))
                runs["evicted"].append(_run_phase("restore", model, directory, prompt_file,
                                                  *common, "--evict"))
            row["restore_warm"] = _median_run(runs["warm"])
            row["restore_evicted"] = _median_run(runs["evicted"])
            path = entry_files(directory)[-1]
            for kind, cold in (("dd_warm", False), ("dd_evicted", True)):
                reads = [dd_read(path, cold=cold) for _ in range(repeats)]
                row[kind] = {"seconds": _median([r["seconds"] for r in reads]),
                             "gb_per_s": _median([r["gb_per_s"] for r in reads])}
            rows.append(row)
            progress(render_row(row))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    from foretell.tools.bench import runtime_info

    return {"machine": machine_info(), "runtime": runtime_info(), "rows": rows}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field medians of several restore runs, with the runs kept beside them."""
    numeric = [k for k, v in runs[0].items() if isinstance(v, float)]
    summary = dict(runs[0])
    summary.update({k: _median([r[k] for r in runs if r[k] is not None]) for k in numeric})
    summary["runs"] = runs
    return summary


def render_row(row: dict[str, Any]) -> str:
    p, rw, re_ = row["prime"], row["restore_warm"], row["restore_evicted"]
    return (f"{row['model']}: cold {p['cold_ttft_s']:.3f}s, RAM hit {p['ram_hit_ttft_s']:.4f}s, "
            f"SSD {rw['ttft_s']:.4f}s warm / {re_['ttft_s']:.4f}s evicted")


def render(report: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md carries."""
    m = report["machine"]
    lines = [
        f"{m['date']} · {m['cpu']} ({m['cores']} cores){' · ' + m['gpu'] if m['gpu'] else ''}"
        f" · load {m['load_avg_1m']} · MLX {report['runtime']['mlx']} "
        f"({report['runtime']['backend']})",
        "",
        "| model | prompt | cold TTFT | RAM hit TTFT | SSD restore TTFT (warm / evicted) | "
        "cold / SSD | restore read GB/s (warm / evicted) | dd GB/s (warm / evicted) | "
        "verified / unverified read | mlx-lm save / load (warm / evicted) | decode tok/s idle / "
        "writing |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        p, rw, re_ = row["prime"], row["restore_warm"], row["restore_evicted"]
        lm = p.get("mlx_lm") or {}
        lm_cell = (f"{lm['save_s']:.3f} / {lm['load_warm_s']:.3f} / {lm['load_evicted_s']:.3f} s"
                   if "save_s" in lm else lm.get("skipped", "n/a"))
        d = p["decode"]
        lines.append(
            f"| {row['model']} | {row['prompt_tokens']} ({p['entry_bytes'] / 1e6:.1f} MB) "
            f"| {p['cold_ttft_s']:.3f} s | {p['ram_hit_ttft_s'] * 1e3:.1f} ms "
            f"| {rw['ttft_s'] * 1e3:.1f} / {re_['ttft_s'] * 1e3:.1f} ms "
            f"| **{p['cold_ttft_s'] / re_['ttft_s']:.0f}×** "
            f"| {rw['read_gb_per_s']:.2f} / {re_['read_gb_per_s']:.2f} "
            f"| {row['dd_warm']['gb_per_s']:.2f} / {row['dd_evicted']['gb_per_s']:.2f} "
            f"| {p['reads']['ratio']:.2f}× ({p['reads']['checksum']}) | {lm_cell} "
            f"| {d['idle_tps']:.1f} / {d['writing_tps']:.1f} ({d['ratio']:.2f}×) |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    from foretell.cli import main as cli_main

    return cli_main(["bench", "--cache", *argv])


if __name__ == "__main__":
    sys.exit(main())
