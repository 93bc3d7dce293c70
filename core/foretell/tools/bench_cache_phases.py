"""The phases of ``foretell bench --cache`` (:mod:`foretell.tools.bench_cache`), each run in a
process of its own, so a "fresh process" restore is one:

    python -m foretell.tools.bench_cache_phases {prime,restore} --model DIR --dir DIR --prompt FILE

``prime`` measures the cold prefill, RAM hits, storing, verified reads, mlx-lm's prompt-cache
files and decode beside the spill worker's writes; ``restore`` opens the tier over what
``prime`` stored and restores. Each prints one ``FORETELL-CACHE-BENCH {json}`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from foretell.config import DEFAULT_LAYOUT
from foretell.tools.measure import median


def evict(paths: Sequence[Path]) -> None:
    """Drop the files' pages from the page cache, so the next read goes to the disk. Dirty
    pages are written back first: DONTNEED leaves them cached (mlx-lm's file is not fsynced,
    so its "evicted" load read from memory)."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):
            pass
        finally:
            os.close(fd)


def stored_files(directory: Path) -> list[Path]:
    """Every file under the cache directory (what an evicted restore must read from disk)."""
    return sorted(p for p in Path(directory).rglob("*") if p.is_file())


def layout_contribution(name: str, registry: Any = None) -> Any:
    """The registered storage layout ``name``; a :class:`BenchError` naming ``--layout``."""
    from foretell.errors import BenchError, ForetellError
    from foretell.plugin.loader import load_plugins
    from foretell.plugin.registry import Kind

    try:
        return (registry or load_plugins().registry).get(Kind.LAYOUT, name)
    except ForetellError as exc:
        raise BenchError(f"--layout {name}: {exc}") from None


def entry_paths(layout: Any, key: str) -> list[Path]:
    """The files a read of ``key`` opens, in the order it reads them (the layout's
    ``files``: the block store's manifest, then blocks; the single-file layout's one file)."""
    if not hasattr(layout, "files"):
        raise RuntimeError(f"layout {type(layout).__name__} names no files for an entry "
                           "(files(key)): the dd row needs them")
    return list(layout.files(key))


def _generate(engine: Any, prompt: list[int], max_tokens: int = 1) -> Any:
    return list(engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True))[-1]


def phase_prime(model: Path, directory: Path, prompt: list[int], args: argparse.Namespace
                ) -> dict[str, Any]:
    """Cold prefill, RAM hits, storing, verified reads, mlx-lm's files, decode under writes."""
    import mlx.core as mx

    import foretell

    engine = foretell.load(model, kv_bits=args.kv_bits)
    _generate(engine, prompt[:64], 4)  # warm-up: first-call costs are nobody's TTFT
    if mx.default_device() != mx.cpu:
        # A GPU compiles kernels per shape on first use: a cold prefill that paid for that
        # would flatter the cache.
        _generate(engine, prompt)
    out: dict[str, Any] = {}
    out["cold_ttft_s"] = _generate(engine, prompt).ttft_s
    if mx.default_device() != mx.cpu:
        out["cold_new_length_ttft_s"] = _new_length_prefills(engine, prompt, args.repeats)
    tier, factory = _open_tier(engine, directory, args.layout)
    engine.cache = tier
    out["cold_ttft_with_store_s"] = _generate(engine, prompt).ttft_s
    hits = [_generate(engine, prompt) for _ in range(args.repeats)]
    out["ram_hit_ttft_s"] = median([h.ttft_s for h in hits])
    out["ram_hit_cached_tokens"] = hits[-1].cached_tokens
    start = time.perf_counter()
    report = tier.flush(600)
    out["flush_s"] = time.perf_counter() - start
    out["durable"] = report.durable
    # The first RAM hits once the entry's bytes were written: on a CUDA GPU a writer that
    # reads the cache on the CPU moves its pages to the host, and the next step over them
    # moves them back (a writer gathering by DMA, as foretell's does there, does not).
    out["ram_hits_after_write_ttft_s"] = [_generate(engine, prompt).ttft_s for _ in range(2)]
    tier.flush(600)  # whatever those requests stored lands before the next phase
    donor = max(tier.ram.entries(), key=lambda e: len(e.tokens))
    layout = tier.ssd.layout
    key = layout.key_for(donor.tokens, donor.namespace)
    paths = entry_paths(layout, key)
    out["layout"] = args.layout
    out["entry_key"] = key
    out["entry_files"] = [str(p) for p in paths]
    out["entry_bytes"] = sum(p.stat().st_size for p in paths)
    out["reads"] = _verified_reads(layout, key, args.repeats)
    out["mlx_lm"] = _mlx_lm_files(donor.caches, directory.parent / "mlx-lm", args.repeats)
    engine.cache = None
    out["decode"] = _decode_under_writes(engine, tier, factory, donor,
                                         directory.parent / "scratch", args)
    tier.close(60)
    return out


def _new_length_prefills(engine: Any, prompt: list[int], repeats: int) -> float:
    """Median time to first token of ``prompt`` less its last 1, 2, ... ``repeats`` tokens:
    prompt lengths this process has not run. A GPU plans its attention kernels per shape and
    keeps the plans, so the cold row, a prompt run once before, reuses its chunks' plans
    where a user's new prompt pays for its last chunk's (docs/speculation.md, "Pipelining
    and the GPU"); this row is that new prompt."""
    return median([_generate(engine, prompt[: len(prompt) - 1 - i]).ttft_s
                    for i in range(repeats)])


def _open_tier(engine: Any, directory: Path, layout_name: str) -> tuple[Any, Callable]:
    """A tier over ``directory`` with the named layout (its default options), and a factory
    for more layouts of the same kind and identity elsewhere."""
    from foretell.cache.tier import CacheTier

    layout_contribution(layout_name, engine.registry)  # an unknown name: one --layout error
    tier = CacheTier.for_engine(engine, directory, layout=layout_name)
    store = tier.ssd.layout
    return tier, lambda root: type(store)(root, store.config, identity=store.identity)


#: Verified and unverified reads taking turns, this many of each (reads take 10-60 ms).
READ_TURNS = 15


def _verified_reads(layout: Any, key: str, repeats: int) -> dict[str, Any]:
    """The entry read with every checksum and with none, taking turns in this process
    (serving always verifies; the unverified path exists for this row only)."""
    from foretell.store import format as fmt

    if not hasattr(layout, "read_layers"):  # both built-in layouts have it
        return {"skipped": f"layout {type(layout).__name__} has no unverified read"}

    def read(verify: bool) -> float:
        start = time.perf_counter()
        layout.read_layers(key, verify=verify)
        return time.perf_counter() - start

    read(True)
    # What checked the bytes (the block store: device digests on a GPU, piece checksums).
    check = getattr(layout, "last_check", "") or fmt.CHECKSUM
    runs: dict[str, list[float]] = {"verified": [], "unverified": []}
    for turn in range(max(READ_TURNS, repeats)):
        # Taking turns, first one then the other, so drift on a shared host hits both.
        for verify in ((False, True) if turn % 2 == 0 else (True, False)):
            runs["verified" if verify else "unverified"].append(read(verify))
    verified, unverified = median(runs["verified"]), median(runs["unverified"])
    return {"verified_s": verified, "unverified_s": unverified,
            "ratio": verified / unverified, "runs": runs, "checksum": check}


def _mlx_lm_files(caches: list[Any], directory: Path, repeats: int) -> dict[str, Any] | None:
    """mlx-lm's prompt-cache file of the same KV: save, then load warm and evicted."""
    try:
        import mlx.core as mx
        from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

        from foretell.cache.quantized import QuantizedKVCache as OurQuantized
        from foretell.model.kvcache import KVCache as OurKV
    except ImportError:
        return None
    theirs = [_as_mlx_lm(cache, OurKV, OurQuantized) for cache in caches]
    if any(cache is None for cache in theirs):
        return {"skipped": "mlx-lm rows need plain or quantized KV caches (a sliding-window "
                           "model here)"}
    mx.eval([c.state for c in theirs])
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
            mx.eval([c.state for c in loaded])
            target.append(time.perf_counter() - start)
    return {"save_s": median(saves), "load_warm_s": median(warm), "load_evicted_s": median(cold),
            "bytes": path.stat().st_size, "fsync": False, "checksums": False}


def _as_mlx_lm(cache: Any, plain: type, quantized: type) -> Any:
    """mlx-lm's cache holding the same KV (a copy), or None for a kind it has no file for."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if type(cache) is plain:
        lm = KVCache()
        lm.keys, lm.values = (mx.array(a) for a in cache.state)
    elif type(cache) is quantized:
        lm = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
        state = [mx.array(a) for a in cache.state]
        lm.keys, lm.values = tuple(state[:3]), tuple(state[3:])
    else:
        return None
    lm.offset = cache.offset
    return lm


def _decode_under_writes(engine: Any, tier: Any, factory: Callable, donor: Any, scratch: Path,
                         args: argparse.Namespace) -> dict[str, Any]:
    from foretell.cache.codecs import snapshot_entry

    # As the tier hands an entry to its spill worker: evaluated, bfloat16 contiguous, with
    # device digests where they are recorded. Unprepared, the writer thread itself ran MLX
    # ops on the strided views (evaluating them, viewing bfloat16 as uint16) beside the
    # decode, which the spill worker never does.
    entry = tier.for_writer(snapshot_entry(donor.tokens, donor.caches, tier.codecs))
    short = list(donor.tokens[:32])
    speeds: dict[str, list[float]] = {"idle": [], "writing": []}
    written, spans = [], {"writing": [], "removing": []}
    for i in range(2 * args.repeats):
        # Alternating order (idle, writing / writing, idle), so drift hits both alike.
        if (i % 2 == 0) == (i % 4 < 2):
            speeds["idle"].append(_generate(engine, short, args.decode_tokens).generation_tps)
            continue
        stop = threading.Event()
        count = [0]
        writer = threading.Thread(target=_write_until,
                                  args=(factory, scratch, entry, stop, count),
                                  kwargs={"spans": spans}, daemon=True)
        writer.start()
        speeds["writing"].append(_generate(engine, short, args.decode_tokens).generation_tps)
        stop.set()
        writer.join()
        written.append(count[0])
    idle, writing = median(speeds["idle"]), median(speeds["writing"])
    # Each writing round against the idle round next to it in time, the median of those:
    # a host's idle decode drifts between rounds minutes apart, which a ratio of the two
    # medians takes for the writer's cost. The speculation bench pairs its rows the same.
    paired = [w / i for i, w in zip(speeds["idle"], speeds["writing"])]
    return {"idle_tps": idle, "writing_tps": writing, "ratio": median(paired),
            "ratio_of_medians": writing / idle, "paired_ratios": paired,
            "entries_written_per_run": written, "entry_bytes": entry.tensor_bytes,
            # How the never-dry writer's time splits: writing a copy, deleting it.
            "write_s": median([b - a for a, b in spans["writing"]]),
            "remove_s": median([b - a for a, b in spans["removing"]]),
            "runs": speeds,
            "interleaved": _decode_beside_interleaved_writes(
                engine, factory, entry, short, scratch, 8 * args.decode_tokens)}


def _decode_beside_interleaved_writes(engine: Any, factory: Callable, entry: Any,
                                      prompt: list[int], scratch: Path, tokens: int
                                      ) -> dict[str, Any]:
    """One long decode while the spill worker writes ``entry``, then rests as long as that
    write took, over and over: each step counts as "writing" when a write ran all through
    it, "removing" when the deletion of a written copy did (a full tier evicts as it
    writes), "idle" when neither ran at any moment of it, and "edge" otherwise (a write or a
    deletion began or ended in it). The phases alternate every write's length within one
    decode, so a host whose own speed drifts between rounds minutes apart weighs on all
    alike; the edges show what starting and
    finishing a write costs (a paired round beside a never-dry writer runs through all).

    A decode of the same length runs first with no writer: a step that only the first decode
    this long pays (on a GPU a kernel built or a forward traced for a longer cache) would
    otherwise land in whatever phase it fell in, and one longer than a write and its rest
    always overlaps a write's start or end, so it would count as an edge."""
    _generate(engine, prompt, tokens)
    steps, spans = interleaved_steps(engine, factory, entry, prompt, scratch, tokens)
    return {**steady_speeds(steps, spans), "writes": len(spans["writing"])}


def interleaved_steps(engine: Any, factory: Callable, entry: Any, prompt: list[int],
                      scratch: Path, tokens: int
                      ) -> tuple[list[tuple[float, float, int]], dict[str, list[tuple[float, float]]]]:
    """The decode of :func:`_decode_beside_interleaved_writes`: its steps after the prefill
    as ``(start, end, tokens)`` and the writer's spans by phase (``writing``, ``removing``)."""
    spans: dict[str, list[tuple[float, float]]] = {"writing": [], "removing": []}
    stop = threading.Event()
    writer = threading.Thread(target=_write_until, args=(factory, scratch, entry, stop, [0]),
                              kwargs={"spans": spans, "rest": True}, daemon=True)
    writer.start()
    steps, last = [], time.perf_counter()
    for event in engine.generate(prompt, max_tokens=tokens, ignore_eos=True):
        now = time.perf_counter()
        if event.type == "text" and event.tokens:
            steps.append((last, now, len(event.tokens)))
        last = now
    stop.set()
    writer.join()
    return steps[1:], spans  # 1: the prefill


def steady_speeds(steps: Sequence[tuple[float, float, int]],
                  spans: dict[str, Sequence[tuple[float, float]]]) -> dict[str, Any]:
    """Tokens per second of the ``(start, end, tokens)`` steps each phase's spans covered
    whole (``spans``: phase name -> its spans), of those no span touched ("idle") and of the
    rest ("edge"); each over idle as ``<phase>_ratio`` (the writing phase's as ``ratio``),
    how many steps of each, and each one's slowest step in seconds (``<phase>_slowest_s``:
    one stall apart from a steady cost)."""
    states = [*spans, "idle", "edge"]
    totals = {state: [0.0, 0, 0, 0.0] for state in states}  # seconds, tokens, steps, slowest
    for begin, end, n in steps:
        inside = [phase for phase, found in spans.items()
                  if any(a <= begin and end <= b for a, b in found)]
        if len(inside) == 1:
            state = inside[0]
        elif any(a < end and begin < b for found in spans.values() for a, b in found):
            state = "edge"
        else:
            state = "idle"
        totals[state][0] += end - begin
        totals[state][1] += n
        totals[state][2] += 1
        totals[state][3] = max(totals[state][3], end - begin)
    tps = {state: n / t if t > 0 else float("nan") for state, (t, n, _k, _s) in totals.items()}
    out: dict[str, Any] = {}
    for state in states:
        out[f"{state}_tps"] = tps[state]
        out[f"{state}_steps"] = totals[state][2]
        out[f"{state}_slowest_s"] = totals[state][3]
        if state != "idle":
            out[f"{state}_ratio"] = tps[state] / tps["idle"] if tps["idle"] > 0 else float("nan")
    out["ratio"] = out.get("writing_ratio", float("nan"))
    return out


def _write_until(factory: Callable, scratch: Path, entry: Any, stop: threading.Event,
                 count: list[int], *, spans: dict[str, list[tuple[float, float]]] | None = None,
                 rest: bool = False) -> None:
    """Keep the spill worker itself (``foretell.cache.spill.SpillQueue``: its priority, its
    pace) writing ``entry`` until told to stop, each time into an empty directory, then
    deleting it: a spill that never runs dry, writing every byte each time (a block store
    would otherwise find every block already stored and write only a manifest), beside a
    full tier's eviction. Each write's start and end go to ``spans["writing"]``, each
    deletion's to ``spans["removing"]``; with ``rest`` the worker waits as long as a write
    took before the next."""
    from foretell.cache.spill import SpillQueue

    took = [0.0]

    def write(stored: Any) -> bool:
        root, start = scratch / f"write-{count[0]}", time.perf_counter()
        try:
            return factory(root).write(stored)
        finally:
            end = time.perf_counter()
            took[0] = end - start
            shutil.rmtree(root, ignore_errors=True)
            if spans is not None:
                spans["writing"].append((start, end))
                spans["removing"].append((end, time.perf_counter()))
            count[0] += 1

    def again(stored: Any, _outcome: str) -> None:
        if not stop.wait(took[0] if rest else 0):
            queue.submit(stored)

    queue = SpillQueue(write, max_bytes=entry.tensor_bytes, on_done=again)
    queue.submit(entry)
    stop.wait()
    queue.close()


def phase_restore(model: Path, directory: Path, prompt: list[int], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """A fresh process: open the tier over what ``prime`` stored, restore, first token."""
    import mlx.core as mx

    import foretell
    from foretell.tools.measure import timed

    start = time.perf_counter()
    engine = foretell.load(model, kv_bits=args.kv_bits)
    loaded_s = time.perf_counter() - start
    _generate(engine, prompt[-64:][:8] if len(prompt) > 8 else prompt, 2)  # warm-up, uncached
    if mx.default_device() != mx.cpu:
        # As for the cold prefill (phase_prime): a GPU's first step at this key length
        # compiles or loads its kernels (even for the 25 MB demo),
        # which is nobody's restore. The prompt runs once uncached, then MLX's buffer cache
        # is emptied, so the restore still lands in fresh memory as after a restart.
        _generate(engine, prompt)
        mx.clear_cache()
    if args.evict:
        evict(stored_files(directory))
    start = time.perf_counter()
    tier, _factory = _open_tier(engine, directory, args.layout)
    scan_s = time.perf_counter() - start  # with the restore reserve's fill, where it has one
    reserve = getattr(tier.ssd.layout, "reserve", None)
    open_fill_s = reserve.fill_seconds if reserve is not None else 0.0
    # What opening the tier spent readying reads (kernels, landing area, reserve), by step.
    open_steps = dict(getattr(tier.ssd.layout, "last_replenish_ms", None) or {}) or None
    reads: list[float] = []
    lookups: list[float] = []
    keys: list[str] = []
    real_read = tier.ssd.read
    started: list[float] = []
    tasks = _timed_io_tasks()

    def read(stored: Any) -> Any:
        keys.append(stored.header.key)
        started.append(time.perf_counter())
        return real_read(stored)

    tier.ssd.read = timed(read, reads)
    tier.lookup = timed(tier.lookup, lookups)
    engine.cache = tier
    stats = _generate(engine, prompt)
    # The layout's own account of that read, where it keeps one (the block store: ms in
    # manifest, buffers, queued, blocks, arrays).
    steps = dict(getattr(tier.ssd.layout, "last_read_ms", None) or {}) or None
    restore_s, lookup_s = sum(reads), sum(lookups)
    # The same prompt again, now a RAM hit on the promoted entry: what the first step after
    # a restore costs beyond a step in a process that has taken one (fresh memory, plans).
    again = _generate(engine, prompt)
    read_bytes = sum(p.stat().st_size for key in keys for p in entry_paths(tier.ssd.layout, key))
    return {"ttft_s": stats.ttft_s, "cached_tokens": stats.cached_tokens,
            "cached_from": stats.cached_from, "model_load_s": loaded_s, "scan_s": scan_s,
            "read_s": restore_s, "read_bytes": read_bytes, "read_keys": keys,
            "read_tasks": _task_timeline(tasks, started[0], reads[0]) if reads else None,
            "read_steps_ms": steps,
            # the tier's lookup: the read, then the caches built and promoted into RAM; the
            # rest of the TTFT is the engine's step over the last prompt token
            "lookup_s": lookup_s, "ram_hit_after_ttft_s": again.ttft_s,
            "read_gb_per_s": read_bytes / restore_s / 1e9 if restore_s else None,
            "evicted": args.evict, "layout": args.layout,
            # the fill the tier's opening paid (off the TTFT), whether the restore's buffers
            # came from it, and its counters after the request's end refilled it
            "reserve_open_fill_s": open_fill_s, "open_steps_ms": open_steps,
            "reserve_served": bool(reserve is not None and reserve.served),
            "reserve": reserve.stats() if reserve is not None else None}


def _timed_io_tasks() -> list[tuple[float, float, int]]:
    """Time every task the store's reader pool runs from now on: ``(start, end, thread)``
    each. Where a fresh process's restore read takes longer than the same read in a process
    that has read before, this says whether the
    time goes before the first task starts, in the tasks, or after the last one ends."""
    import threading

    from foretell.store import format as fmt

    pool, spans = fmt.io_pool(), []
    submit = pool.submit

    def timed_submit(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        def task() -> Any:
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((begin, time.perf_counter(), threading.get_ident()))
        return submit(task)

    pool.submit = timed_submit
    return spans


def _task_timeline(spans: list[tuple[float, float, int]], start: float, seconds: float
                   ) -> dict[str, Any] | None:
    """The first read's reader tasks, in ms from the read's start: when the first began,
    when the last ended, their summed busy time and over how many threads, and what the read
    took after the last task (assembling the arrays)."""
    mine = [span for span in spans if start <= span[0] <= start + seconds]
    if not mine:
        return None
    last = max(end for _begin, end, _thread in mine)
    firsts: dict[int, float] = {}
    for begin, end, thread in sorted(mine):
        firsts.setdefault(thread, end - begin)
    return {"tasks": len(mine), "threads": len(firsts),
            # a thread's first task also pays its setup (a CUDA reader's stream and events)
            "first_task_per_thread_ms": median(list(firsts.values())) * 1e3,
            "task_median_ms": median([end - begin for begin, end, _t in mine]) * 1e3,
            "first_start_ms": (min(begin for begin, _e, _t in mine) - start) * 1e3,
            "last_end_ms": (last - start) * 1e3,
            "busy_ms": sum(end - begin for begin, end, _t in mine) * 1e3,
            "after_ms": (start + seconds - last) * 1e3}


PHASES: dict[str, Callable[..., dict[str, Any]]] = {"prime": phase_prime,
                                                     "restore": phase_restore}


def main(argv: Sequence[str] | None = None) -> int:
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
    parser.add_argument("--layout", default=DEFAULT_LAYOUT)
    parser.add_argument("--kv-bits", type=int, default=None)
    args = parser.parse_args(argv)
    prompt = json.loads(args.prompt.read_text())
    result = PHASES[args.phase](args.model, args.dir, prompt, args)
    print("FORETELL-CACHE-BENCH " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
