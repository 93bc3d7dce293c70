"""A load generator against two real servers on the same weights: ``foretell serve`` and
``mlx_lm.server``, each started as a user starts it on a free localhost port, driven by the
official ``openai`` client at concurrency 1, 2, 4, 8, 16, 32.

Every request is a streamed ``/v1/completions`` of a stretch of the Python standard
library's source (``--prompt-tokens``), greedy, ``--max-tokens`` long; each level sends
``max(4, 2 * concurrency)`` requests, bounded by ``--timeout`` seconds a level. Reported per
server and level: generated tokens per second over the level's wall time, TTFT p50/p99 and
the gaps between streamed chunks (inter-token latency) p50/p99. On the CPU mlx-lm runs on a
float32 copy of the weights (foretell computes the demo's quantized weights unpacked to
float32), both with foretell's OpenBLAS (DESIGN.md §5). foretell runs without its model
stop strings, as mlx-lm has none.

    python benchmarks/serve_load.py --model demo --levels 1,2,4,8,16,32 --json out.json

It measures, never asserts; localhost only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

#: mlx_lm.server, started with foretell's BLAS bound first (the same BLAS on both sides).
MLX_LM_SERVER = ("from foretell.platform import blas; blas.preload(); import runpy, sys; "
                 "sys.argv = ['mlx_lm.server'] + sys.argv[1:]; "
                 "runpy.run_module('mlx_lm.server', run_name='__main__')")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(name: str, model: Path, tokens: int, draft: list[str]) -> tuple[subprocess.Popen, str]:
    """One server process and its base URL, once it answers."""
    import urllib.request

    port = free_port()
    if name == "foretell":
        argv = [sys.executable, "-m", "foretell", "serve", "--model", str(model), "--port",
                str(port), *draft, "--no-model-stops", "--no-access-log",
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else 0.0


async def level(url: str, model_id: str, prompts: list[str], concurrency: int,
                max_tokens: int, timeout: float) -> dict[str, float]:
    import openai

    # The client's own retries, as an application gets them (a server whose listen queue
    # overflows drops connections a retry gets through); the time they take counts.
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
    queue = list(prompts)
    ttfts, gaps, counts, failed = [], [], [], []

    async def worker() -> None:
        while queue:
            prompt = queue.pop()
            sent = time.perf_counter()
            try:
                stream = await client.completions.create(
                    model=model_id, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                    stream=True, stream_options={"include_usage": True})
                last, used = None, 0
                async for chunk in stream:
                    if chunk.usage is not None:
                        used = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].text:
                        now = time.perf_counter()
                        if last is None:
                            ttfts.append(now - sent)
                        else:
                            gaps.append(now - last)
                        last = now
            except openai.APIError as exc:  # counted and reported, not a crash of the level
                failed.append(type(exc).__name__)
                continue
            counts.append(used)

    started = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout)
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": len(counts), "failed": len(failed),
            "tokens": sum(counts),
            "tokens_per_s": sum(counts) / wall, "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "itl_p50_s": percentile(gaps, 0.5),
            "itl_p99_s": percentile(gaps, 0.99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a model directory or shipped name")
    parser.add_argument("--levels", default="1,2,4,8,16,32", help="concurrency levels")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a level may take")
    parser.add_argument("--float32-mlx-lm", action=argparse.BooleanOptionalAction, default=True,
                        help="run mlx-lm on a float32 copy of the weights (the CPU's fair bar)")
    parser.add_argument("--draft", default="none", help="foretell's drafter (--draft)")
    parser.add_argument("--draft-model", default=None, help="foretell's --draft-model")
    parser.add_argument("--servers", default="foretell,mlx-lm", help="which servers to run")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
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
    draft = ["--draft", args.draft] + (["--draft-model", args.draft_model]
                                       if args.draft_model else [])
    report = {"model": str(model), "machine": machine_info(), "prompt_tokens":
              args.prompt_tokens, "max_tokens": args.max_tokens, "foretell": draft, "rows": []}
    for name, path in models.items():
        proc, url = start(name, path, args.max_tokens, draft)
        try:
            model_id = model.name if name == "foretell" else str(path)
            for c in levels:
                prompts = [tokenizer.decode(ids) for ids in
                           prompts_for(model, max(4, 2 * c), args.prompt_tokens, 7 * c)]
                row = asyncio.run(level(url, model_id, prompts, c, args.max_tokens,
                                        args.timeout))
                row["server"] = name
                report["rows"].append(row)
                print(f"{name:9s} c={c:2d}  {row['tokens_per_s']:7.1f} tok/s  TTFT p50 "
                      f"{row['ttft_p50_s']:.3f} p99 {row['ttft_p99_s']:.3f} s  ITL p50 "
                      f"{row['itl_p50_s'] * 1e3:.1f} p99 {row['itl_p99_s'] * 1e3:.1f} ms"
                      + (f"  {row['failed']} failed" if row["failed"] else ""),
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=120)
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
    main()
