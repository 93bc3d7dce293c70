"""A load generator against two real servers on the same weights: ``foretell serve`` and
``mlx_lm.server``, each started as a user starts it on a free localhost port, driven by the
official ``openai`` client at concurrency 1, 2, 4, 8, 16, 32.

Every request is a streamed ``/v1/completions`` of a stretch of the Python standard
library's source (``--prompt-tokens``), greedy, ``--max-tokens`` long, each prompt sent once.
Before a level each server answers one untimed wave of ``concurrency`` requests sent at
once (``--no-warm`` skips it), so no level's figures hold one-off costs: a first request's,
or a batch shape's first use (CUDA kernels compiled on first sight). A level's clients
start together and send ``--requests`` requests (default ``max(4, 2 * concurrency)``) or,
with ``--level-seconds``, keep sending until that many seconds have passed, so that a p99
is not one burst's worst; ``--timeout`` bounds a level either way. Reported per server: the
seconds from its start to its first answer (``start_s``: loading, and ``foretell serve``'s
warm-up where the device compiles per shape). Per server and level: generated tokens per second over the level's wall time, TTFT p50/p99, the worst TTFT
of the first wave (the ``concurrency`` requests sent at once as the level starts) and the
gaps between streamed chunks (inter-token latency) p50/p99; for foretell, its own mean TTFT
(from submission, its ``/metrics``) and the wait for admission within it, so that a level's
TTFT splits into HTTP (with the clients' own time), queue, and prefill with the first step;
then each level's TTFT p99 against c = 1's p50 (the strict reading of "within 3x of TTFT at
1") and against its p99. Every request asks for ``--max-tokens``, so a level's clients
finish and send again together, each wave a burst; ``--max-tokens-spread S`` draws each
request's from ``--max-tokens`` +- S instead. The openai client's own Python costs ~0.1 ms a streamed chunk (a
core at ~8,000 chunks/s): on a host with cores to spare, ``--client-processes N`` spreads a
level's clients over N processes, so that a busy client is not what a level measures.
``--floor-repeats N`` measures what no server can beat, in this process after the servers
stopped: the model's own compute for a level's first wave (its prompts in one prefill
forward, then one decode step over them: a first token each), the least of N runs, against
one prompt's; its ratio is the least a server's TTFT at that level can be over c = 1's here.
On the CPU mlx-lm runs on a float32 copy of the weights (foretell computes the demo's
quantized weights unpacked to float32), both with foretell's OpenBLAS (DESIGN.md §5).
foretell runs without its model stop strings, as mlx-lm has none; ``--serve-arg=FLAG``
gives ``foretell serve`` another flag (an A/B of one of its settings).

    python benchmarks/serve_load.py --model demo --levels 1,2,4,8,16,32 --json out.json
    python benchmarks/serve_load.py --levels 1,16 --level-seconds 30 --servers foretell
    python benchmarks/serve_load.py --levels 1,16 --servers foretell --serve-arg=--max-rows=8

It measures, never asserts; localhost only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: mlx_lm.server, started with foretell's BLAS bound first (the same BLAS on both sides).
MLX_LM_SERVER = ("from foretell.platform import blas; blas.preload(); import runpy, sys; "
                 "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                 "runpy.run_module('mlx_lm.server', run_name='__main__')")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(name: str, model: Path, tokens: int, flags: list[str]) -> tuple[subprocess.Popen, str]:
    """One server process and its base URL, once it answers (``flags``: foretell's own)."""
    import urllib.request

    port = free_port()
    if name == "foretell":
        argv = [sys.executable, "-m", "foretell", "serve", "--model", str(model), "--port",
                str(port), *flags, "--no-model-stops", "--no-access-log",
                "--max-tokens", str(tokens)]
    else:
        argv = [sys.executable, "-c", MLX_LM_SERVER, "--model", str(model), "--port", str(port),
                "--log-level", "WARNING"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} server never answered")


def server_latency(url: str) -> dict[str, float] | None:
    """foretell's own latency sums and counts (its ``/metrics`` histograms: time to first
    token from submission, and the wait for admission within it); None for a server
    without them."""
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return None
    values = dict(line.rsplit(" ", 1) for line in text.splitlines()
                  if line and not line.startswith("#"))
    names = {"ttft": "foretell_time_to_first_token_seconds",
             "queue": "foretell_request_queue_seconds"}
    if not all(f"{name}_count" in values for name in names.values()):
        return None
    return {f"{key}_{part}": float(values[f"{name}_{part}"])
            for key, name in names.items() for part in ("sum", "count")}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


#: Prompts a timed level holds ready per client and second: more than either server completes
#: (each request generates ``--max-tokens`` tokens; 10 ran out at c = 1 on a GPU); a level
#: that runs out says so.
PROMPTS_PER_CLIENT_SECOND = 40


async def clients(url: str, model_id: str, prompts: list[str], concurrency: int,
                  max_tokens: int | list[int], timeout: float, seconds: float = 0.0,
                  start_at: float | None = None) -> dict:
    """``concurrency`` clients in this process sending ``prompts`` (each once; ``max_tokens``
    for each, or one for all) until none is left or, with ``seconds``, until that many
    seconds have passed, from ``start_at`` (``time.monotonic``; default: now). Returns what
    each request measured, unreduced."""
    import openai

    # The client's own retries, as an application gets them (a server whose listen queue
    # overflows drops connections a retry gets through); the time they take counts.
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    queue = list(reversed(list(zip(prompts, lengths))))
    got: dict[str, Any] = {k: [] for k in ("ttfts", "burst", "steady", "gaps", "counts",
                                           "failed", "walls", "tails")}

    async def request(prompt: str, length: int, first_wave: bool) -> None:
        sent = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=model_id, prompt=prompt, max_tokens=length, temperature=0.0,
                stream=True, stream_options={"include_usage": True})
            last, used = None, 0
            async for chunk in stream:
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
                if chunk.choices and chunk.choices[0].text:
                    now = time.perf_counter()
                    if last is None:
                        got["ttfts"].append(now - sent)
                        got["burst" if first_wave else "steady"].append(now - sent)
                    else:
                        got["gaps"].append(now - last)
                    last = now
        except openai.APIError as exc:  # counted and reported, not a crash of the level
            got["failed"].append(type(exc).__name__)
            return
        ended = time.perf_counter()
        got["counts"].append(used)
        got["walls"].append(ended - sent)
        if last is not None:
            got["tails"].append(ended - last)

    async def worker() -> None:
        first = True
        while queue and (not seconds or time.monotonic() < started + seconds or first):
            await request(*queue.pop(), first_wave=first)
            first = False

    try:
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        started = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout)
        got["started_at"], got["ended_at"] = started, time.monotonic()
    finally:
        await client.close()  # in this loop: closed after it ends, it raised at exit
    got["ran_out"] = bool(seconds) and not queue
    return got


def _client_process() -> None:
    """One process of a level's clients (``--client-processes``): "ready" once its imports
    are done, then its arguments (JSON) on stdin, its measurements (JSON) on stdout."""
    import openai  # noqa: F401 - imported before it says ready: not on the level's clock

    print("ready", flush=True)
    args = json.loads(sys.stdin.readline())
    print(json.dumps(asyncio.run(clients(**args))), flush=True)


def in_processes(processes: int, url: str, model_id: str, prompts: list[str],
                 concurrency: int, max_tokens: int | list[int], timeout: float,
                 seconds: float) -> dict:
    """:func:`clients` over ``processes`` processes, the level's clients and prompts dealt out
    between them, all starting at one moment; their measurements merged."""
    share = [n for n in (concurrency // processes + (i < concurrency % processes)
                         for i in range(processes)) if n]
    procs = [subprocess.Popen([sys.executable, __file__, "--client-process"], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for _ in share]
    try:
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a client process failed to start")
        start_at = time.monotonic() + 0.5  # CLOCK_MONOTONIC: one clock for every process
        for i, (proc, n) in enumerate(zip(procs, share)):
            proc.stdin.write(json.dumps({
                "url": url, "model_id": model_id, "prompts": prompts[i::len(share)],
                "concurrency": n, "timeout": timeout, "max_tokens": max_tokens[i::len(share)]
                if isinstance(max_tokens, list) else max_tokens,
                "seconds": seconds, "start_at": start_at}) + "\n")
            proc.stdin.flush()
        parts = [json.loads(proc.stdout.readline()) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    merged = {key: [v for part in parts for v in part[key]] for key in parts[0]
              if isinstance(parts[0][key], list)}
    merged["started_at"] = min(part["started_at"] for part in parts)
    merged["ended_at"] = max(part["ended_at"] for part in parts)
    merged["ran_out"] = any(part["ran_out"] for part in parts)
    return merged


async def level(url: str, model_id: str, prompts: list[str], concurrency: int,
                max_tokens: int, timeout: float, seconds: float = 0.0,
                warm: Sequence[str] = (), processes: int = 1,
                spread: int = 0) -> dict[str, float]:
    """One level: ``warm``, prompts sent at once and answered before the clock starts (a
    failure among them stays counted); then :func:`clients`, in ``processes`` processes
    where a host has cores to spare, so that the clients' own Python is not what is measured.
    Reduced to the level's figures, with the server's own view where it reports one.
    ``spread``: each request's ``max_tokens`` drawn from ``max_tokens`` +- ``spread`` (the
    same draws for every server), so that clients do not finish, and send again, together."""
    lengths: int | list[int] = max_tokens
    if spread:
        draw = random.Random(concurrency)
        lengths = [max(1, max_tokens + draw.randint(-spread, spread)) for _ in prompts]
    failed = []
    if warm:
        failed = (await clients(url, model_id, list(warm), len(warm), max_tokens,
                                timeout))["failed"]
    before = await asyncio.to_thread(server_latency, url)
    if processes > 1:
        got = await asyncio.to_thread(in_processes, processes, url, model_id, prompts,
                                      concurrency, lengths, timeout, seconds)
    else:
        got = await clients(url, model_id, prompts, concurrency, lengths, timeout, seconds)
    after = await asyncio.to_thread(server_latency, url) if before is not None else None
    # The server's own view of the level's requests: what of the client's TTFT it saw (from
    # submission) and the wait for admission within that; the rest is HTTP and the loop.
    inside = {}
    if before is not None and after is not None:
        served = after["ttft_count"] - before["ttft_count"]
        if served:
            inside = {f"server_{key}_mean_s": (after[f"{key}_sum"] - before[f"{key}_sum"]) / served
                      for key in ("ttft", "queue")}
    ttfts, gaps, counts = got["ttfts"], got["gaps"], got["counts"]
    walls, tails, wall = got["walls"], got["tails"], got["ended_at"] - got["started_at"]
    return {**inside, "concurrency": concurrency, "client_processes": processes,
            "requests": len(counts), "failed": len(failed) + len(got["failed"]),
            "prompts_ran_out": got["ran_out"],
            "seconds": wall, "tokens": sum(counts), "tokens_per_s": sum(counts) / wall,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "ttft_mean_s": sum(ttfts) / max(len(ttfts), 1),
            "ttft_first_wave_max_s": max(got["burst"], default=0.0),
            # Past the level's first wave (all its clients sending at once as it starts).
            "ttft_steady_p99_s": percentile(got["steady"], 0.99),
            "itl_p50_s": percentile(gaps, 0.5), "itl_p99_s": percentile(gaps, 0.99),
            "itl_mean_s": sum(gaps) / max(len(gaps), 1),
            "request_mean_s": sum(walls) / max(len(walls), 1),
            "tail_p50_s": percentile(tails, 0.5), "tail_p99_s": percentile(tails, 0.99)}


def compute_floor(model: Path, levels: list[int], prompt_tokens: int, repeats: int
                  ) -> list[dict]:
    """Per level (and c = 1), the least of ``repeats`` runs of the model's compute for that
    many prompts arriving at once: all but each one's last token in one prefill forward (as
    the scheduler prefills a burst together, its caches evaluated as it evaluates them), then
    one decode step over every row, which draws each one's first token."""
    import mlx.core as mx

    from foretell.concurrency import mlx_work
    from foretell.engine import load
    from foretell.model.batch import batch_caches, layer_caches
    from foretell.tools.bench_batch import prompts_for

    engine = load(model)

    def first_tokens(prompts: list[list[int]]) -> float:
        started = time.perf_counter()
        caches = batch_caches(engine.model, bits=engine.kv_bits,
                              group_size=engine.kv_group_size)
        for cache in caches:
            cache.append([None] * len(prompts))
        engine.model.forward(mx.array([p[:-1] for p in prompts], dtype=mx.int32), caches)
        mx.eval([c.state for cache in caches for b in range(len(prompts))
                 for c in [cache.extract(b)]])
        hidden, _ = engine.model.forward(mx.array([p[-1:] for p in prompts], dtype=mx.int32),
                                         layer_caches(caches))
        mx.argmax(engine.model.logits(hidden[:, -1, :]), axis=-1).tolist()
        return time.perf_counter() - started

    best: dict[int, float] = {}
    with mlx_work(), engine.settings.active():
        first_tokens(prompts_for(model, 1, prompt_tokens, 1))  # one-off costs
        for r in range(repeats):
            for c in sorted({1, *levels}):
                took = first_tokens(prompts_for(model, c, prompt_tokens, 1000 * r + c))
                best[c] = min(best.get(c, took), took)
    return [{"concurrency": c, "seconds": t, "over_c1": t / best[1]} for c, t in best.items()]


def ttft_ratios(rows: list[dict]) -> list[dict]:
    """Per server and level above 1, TTFT p99 over c = 1's p50 (the target's strict
    reading) and over c = 1's p99; and the p99 past the level's first wave over c = 1's p50,
    where measured."""
    ratios = []
    for row in rows:
        alone = next((r for r in rows if r["server"] == row["server"]
                      and r["concurrency"] == 1), None)
        if alone is None or row["concurrency"] == 1 or not alone["ttft_p50_s"]:
            continue
        ratio = {"server": row["server"], "concurrency": row["concurrency"],
                 "p99_over_c1_p50": row["ttft_p99_s"] / alone["ttft_p50_s"],
                 "p99_over_c1_p99": row["ttft_p99_s"] / alone["ttft_p99_s"]}
        if row.get("ttft_steady_p99_s"):
            ratio["steady_p99_over_c1_p50"] = row["ttft_steady_p99_s"] / alone["ttft_p50_s"]
        ratios.append(ratio)
    return ratios


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a model directory or shipped name")
    parser.add_argument("--levels", default="1,2,4,8,16,32", help="concurrency levels")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-tokens-spread", type=int, default=0,
                        help="each request's max_tokens drawn from --max-tokens +- this (the "
                             "same draws for both servers): clients then finish, and send "
                             "again, at different moments instead of in one wave")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests a level sends (default max(4, 2 * concurrency); "
                             "with --level-seconds, at least)")
    parser.add_argument("--level-seconds", type=float, default=0.0,
                        help="keep each level's clients sending for this many seconds")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                        help="one untimed wave of requests to each server before each level")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a level may take")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="spread a level's clients over this many processes (on a host "
                             "with cores to spare: the openai client's own Python costs "
                             "~0.1 ms a streamed chunk, a core at ~8,000 chunks/s)")
    parser.add_argument("--floor-repeats", type=int, default=0,
                        help="then measure each level's compute floor, the least of N runs")
    parser.add_argument("--float32-mlx-lm", action=argparse.BooleanOptionalAction, default=True,
                        help="run mlx-lm on a float32 copy of the weights (the CPU's fair bar)")
    parser.add_argument("--draft", default="none", help="foretell's drafter (--draft)")
    parser.add_argument("--draft-model", default=None, help="foretell's --draft-model")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="another flag for `foretell serve`, given with '=' (repeatable: "
                             "--serve-arg=--max-rows=16): an A/B of a server setting")
    parser.add_argument("--servers", default="foretell,mlx-lm", help="which servers to run")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    from foretell.platform import blas

    blas.preload()  # before mlx is imported: the compute floor runs in this process
    from foretell.engine import resolve_model_path
    from foretell.tokenizer import Tokenizer
    from foretell.tools.bench_batch import float32_copy, prompts_for
    from foretell.tools.measure import machine_info

    model = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_dir(model)
    levels = [int(c) for c in args.levels.split(",")]
    servers = args.servers.split(",")
    models = {"foretell": model} if "foretell" in servers else {}
    if "mlx-lm" in servers:
        models["mlx-lm"] = float32_copy(model) if args.float32_mlx_lm else model
    flags = ["--draft", args.draft] + (["--draft-model", args.draft_model]
                                       if args.draft_model else []) + args.serve_arg
    report = {"model": str(model), "machine": machine_info(), "prompt_tokens":
              args.prompt_tokens, "max_tokens": args.max_tokens,
              "max_tokens_spread": args.max_tokens_spread, "foretell": flags,
              "requests": args.requests, "level_seconds": args.level_seconds,
              "warm": args.warm, "rows": []}
    for name, path in models.items():
        began = time.monotonic()
        proc, url = start(name, path, args.max_tokens, flags)
        report.setdefault("start_s", {})[name] = time.monotonic() - began
        print(f"{name}: answering {report['start_s'][name]:.1f} s after its start", flush=True)
        try:
            model_id = model.name if name == "foretell" else str(path)
            for c in levels:
                count = args.requests or max(4, 2 * c)
                if args.level_seconds:
                    count = max(count, int(args.level_seconds * c * PROMPTS_PER_CLIENT_SECOND))
                # Each prompt once (a repeat would be a prefix-cache hit); the warm-up's are
                # the last, so they cache no level prompt.
                ids = dict.fromkeys(map(tuple, prompts_for(model, count + c,
                                                           args.prompt_tokens, 7 * c)))
                prompts = [tokenizer.decode(list(p)) for p in ids]
                row = asyncio.run(level(url, model_id, prompts[:-c], c, args.max_tokens,
                                        args.timeout, args.level_seconds,
                                        prompts[-c:] if args.warm else (),
                                        processes=min(args.client_processes, c),
                                        spread=args.max_tokens_spread))
                row["server"] = name
                report["rows"].append(row)
                print(f"{name:9s} c={c:2d}  {row['requests']:4d} req  {row['tokens_per_s']:7.1f} "
                      f"tok/s  TTFT p50 {row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.3f} s "
                      f"(first wave max {row['ttft_first_wave_max_s']:.3f}, after it p99 "
                      f"{row['ttft_steady_p99_s']:.3f})  ITL p50 "
                      f"{row['itl_p50_s'] * 1e3:.1f} p99 {row['itl_p99_s'] * 1e3:.1f} mean "
                      f"{row['itl_mean_s'] * 1e3:.1f} ms  request {row['request_mean_s'] * 1e3:.0f}"
                      f" ms (last token to end p50 {row['tail_p50_s'] * 1e3:.1f} ms)"
                      + (f"  server: TTFT mean {row['server_ttft_mean_s'] * 1e3:.1f} ms, queue "
                         f"{row['server_queue_mean_s'] * 1e3:.1f} ms (TTFT mean "
                         f"{row['ttft_mean_s'] * 1e3:.1f} ms)" if "server_ttft_mean_s" in row
                         else "")
                      + (f"  {row['failed']} failed" if row["failed"] else "")
                      + ("  (ran out of prompts)" if row["prompts_ran_out"] else ""),
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    report["ttft_ratios"] = ttft_ratios(report["rows"])
    for ratio in report["ttft_ratios"]:
        print(f"{ratio['server']:9s} c={ratio['concurrency']:2d}: TTFT p99 is "
              f"{ratio['p99_over_c1_p50']:.1f}x c = 1's p50, {ratio['p99_over_c1_p99']:.1f}x "
              "its p99" + (f"; past the first wave {ratio['steady_p99_over_c1_p50']:.1f}x c = 1's "
                           "p50" if "steady_p99_over_c1_p50" in ratio else ""))
    if args.floor_repeats:
        report["floor"] = compute_floor(model, levels, args.prompt_tokens, args.floor_repeats)
        for floor in report["floor"]:
            print(f"floor     c={floor['concurrency']:2d}: first tokens of a first wave in "
                  f"{floor['seconds'] * 1e3:.1f} ms of compute, {floor['over_c1']:.1f}x c = 1's")
    if args.json:
        from foretell.tools.measure import portable

        # No machine-local paths in a report that may be committed to docs/bench-data.
        Path(args.json).write_text(json.dumps(portable(report), indent=2))
    for row in report["rows"]:
        if row["server"] == "foretell":
            theirs = next((r for r in report["rows"] if r["server"] == "mlx-lm"
                           and r["concurrency"] == row["concurrency"]), None)
            if theirs is None:
                continue
            print(f"c={row['concurrency']:2d}: foretell / mlx_lm.server throughput "
                  f"{row['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    if sys.argv[1:] == ["--client-process"]:
        _client_process()
    else:
        main()
