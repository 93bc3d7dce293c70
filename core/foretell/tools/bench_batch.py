"""``foretell bench --batch``: many requests at once, foretell's scheduler against mlx-lm's
``BatchGenerator`` on the same prompts, in one run.

Each side runs in its own process (``python -m foretell.tools.bench_batch --side ...``), the
sides taking turns per batch size. For every B the same B prompts (stretches of Python
source) start together; reported per side: aggregate decode tok/s (tokens after each
request's first, over the time from the last first token to the last token), all tokens over
the whole wall time, and TTFT p50/p99; each ratio is the median of the ratios within a turn
(:func:`paired_ratios`). On the CPU foretell computes quantized weights unpacked to float32,
so mlx-lm runs on a float32 copy of the same weights (``mlx_lm.convert --dequantize``) with
the same OpenBLAS: the engine-to-engine comparison (DESIGN.md §5).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from foretell.tools.measure import (
    CACHE_DIR,
    machine_info,
    median,
    paired_ratio,
    paired_ratio_ci,
    runtime_info,
)

#: The plain (not drafting) foretell side's name: the drafting sides' other ratio.
PLAIN = "foretell plain"


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(started: float, firsts: Sequence[float], ends: Sequence[float],
              counts: Sequence[int]) -> dict[str, float]:
    """One batch's figures from each request's first-token and last-token times."""
    decode_span = max(ends) - max(firsts)
    after_first = sum(n - 1 for n in counts)
    ttfts = [f - started for f in firsts]
    return {
        "decode_tps": after_first / decode_span if decode_span > 0 else 0.0,
        "total_tps": sum(counts) / (max(ends) - started),
        "ttft_p50_s": _percentile(ttfts, 0.5),
        "ttft_p99_s": _percentile(ttfts, 0.99),
        "tokens": sum(counts),
    }


def prompts_for(model: Path, batch: int, length: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens: stretches of the Python standard library's
    source (what the demo models were trained on; a drafter's acceptance there is a code
    completion's), each from its own place."""
    from foretell.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model)
    source = "".join(Path(m.__file__).read_text() for m in _stdlib_modules())
    ids = tokenizer.encode(source)
    rng = random.Random(seed)
    return [ids[start : start + length]
            for start in (rng.randrange(0, len(ids) - length) for _ in range(batch))]


def _stdlib_modules() -> list[Any]:
    import argparse as a
    import inspect as i
    import json.decoder as d

    return [a, i, d]


# -- one side, in its own process -----------------------------------------------------------


def use_drafter(engine: Any, draft: str, draft_model: str | None = None,
                max_tokens: int | None = None) -> Any:
    """Set ``engine``'s drafter as a user's ``--draft`` does (``draft_model``: a two-model
    drafter's ``--draft-model``) and return its speculator. Where the device compiles
    kernels per shape this also runs its warm-up over every draft length
    (:mod:`foretell.spec.warmup`)."""
    from foretell.plugin import Kind

    config = engine.registry.get(Kind.DRAFT, draft).config
    options = None
    if config is not None:
        options = config(model=draft_model) if draft == "two-model" else config()
    return engine.use_draft(draft, options, max_tokens=max_tokens)


def _foretell_side(model: str, draft: str | None, draft_model: str | None,
                   k: int) -> Callable[[list[list[int]], int], dict[str, float]]:
    import foretell

    engine = foretell.load(model)
    from foretell.scheduler import Scheduler

    speculate: Any = False
    if draft is not None:
        speculate = use_drafter(engine, draft, draft_model, max_tokens=k)
    scheduler = Scheduler(engine, max_rows=64)

    def run(prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
        return run_requests(scheduler, prompts, max_tokens, speculate)

    return run


def run_requests(scheduler: Any, prompts: list[list[int]], max_tokens: int,
                 speculate: Any) -> dict[str, float]:
    """``prompts`` submitted at once to ``scheduler`` (greedy, ``max_tokens`` each, EOS
    ignored, ``speculate`` as :meth:`~foretell.scheduler.Scheduler.submit` takes it), read
    to their ends by one reader, as mlx-lm's loop is one consumer of its batch:
    :func:`summarize`'s figures."""
    from foretell.stream import merged

    firsts, ends, counts = [0.0] * len(prompts), [0.0] * len(prompts), [0] * len(prompts)
    started = time.perf_counter()
    handles = [scheduler.submit(p, max_tokens=max_tokens, ignore_eos=True,
                                speculate=speculate) for p in prompts]
    for i, event in merged(handles):
        if event.type == "text" and event.tokens:
            if not counts[i]:
                firsts[i] = time.perf_counter()
            counts[i] += len(event.tokens)
        elif event.type == "stats":
            ends[i] = time.perf_counter()
    return summarize(started, firsts, ends, counts)


def _mlx_lm_side(model: str) -> Callable[[list[list[int]], int], dict[str, float]]:
    from foretell.platform import blas

    blas.preload()  # the same optimized BLAS as foretell's side
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator

    loaded, _ = load(model)

    def run(prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
        generator = BatchGenerator(loaded, max_tokens=max_tokens, stop_tokens=[],
                                   completion_batch_size=max(32, len(prompts)),
                                   prefill_batch_size=max(8, len(prompts)))
        started = time.perf_counter()
        uids = generator.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        where = {uid: i for i, uid in enumerate(uids)}
        firsts, ends, counts = [0.0] * len(prompts), [0.0] * len(prompts), [0] * len(prompts)
        left = len(prompts)
        while left:
            for response in generator.next_generated():
                i = where[response.uid]
                now = time.perf_counter()
                if not counts[i]:
                    firsts[i] = now
                counts[i] += 1
                if response.finish_reason is not None:
                    ends[i] = now
                    left -= 1
        generator.close()
        return summarize(started, firsts, ends, counts)

    return run


def _worker(args: argparse.Namespace) -> int:
    if args.side == "foretell":
        run = _foretell_side(args.model, args.draft, args.draft_model, args.k)
    else:
        run = _mlx_lm_side(args.model)
    for result in answer_jobs(run, sys.stdin):
        print(json.dumps(result), flush=True)
    return 0


def answer_jobs(run: Callable[[list[list[int]], int], dict[str, float]],
                lines: Iterable[str]) -> Iterator[dict[str, float]]:
    """Each job's figures; the first job of each batch size follows an untimed warm-up of
    that size (the same prompts to the same length: a few tokens never met the drafted
    shapes a speculating side's policy tries), so no timed run pays for shapes new to the
    process (on GPUs, kernels compiled per shape cost 0.1-0.2 s each)."""
    warmed: set[int] = set()
    for line in lines:
        job = json.loads(line)
        prompts = job["prompts"]
        if len(prompts) not in warmed:
            run(prompts, job["max_tokens"])
            warmed.add(len(prompts))
        yield run(prompts, job["max_tokens"])


# -- the comparison -------------------------------------------------------------------------


class _Side:
    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "foretell.tools.bench_batch", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, job: dict[str, Any]) -> dict[str, float]:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a bench worker ({self.proc.args[3:]}) exited")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def float32_copy(model: Path) -> Path:
    """mlx-lm's own float32 copy of ``model`` (dequantized), made once."""
    import hashlib

    tag = hashlib.sha256(str(model.resolve()).encode()).hexdigest()[:10]
    out = CACHE_DIR / "float32" / f"{model.name}-{tag}"
    if not (out / "config.json").exists():
        from mlx_lm import convert

        out.parent.mkdir(parents=True, exist_ok=True)
        convert(str(model), mlx_path=str(out), dequantize=True, dtype="float32")
    return out


def run_batch_bench(model: Path, *, batches: Sequence[int], prompt_tokens: int,
                    max_tokens: int, repeats: int, drafts: Sequence[str | None],
                    draft_model: str | None, k: int, float32_mlx_lm: bool,
                    progress: Callable[[str], None]) -> dict[str, Any]:
    """Every batch size ``repeats`` times on each side, the sides taking turns in an order
    that rotates by one side a turn."""
    theirs_model = float32_copy(model) if float32_mlx_lm else model
    sides = {"mlx-lm": _Side(["--side", "mlx-lm", "--model", str(theirs_model)])}
    for draft in drafts:
        argv = ["--side", "foretell", "--model", str(model), "--k", str(k)]
        if draft is not None:
            argv += ["--draft", draft] + (["--draft-model", draft_model] if draft_model else [])
        sides[f"foretell {draft}" if draft else PLAIN] = _Side(argv)
    rows = []
    names = list(sides)
    try:
        for batch in batches:
            # Before anything is timed each side warms up at this B: on a fresh GPU host its
            # kernels compile then, minutes in all, and silence would read as a hang.
            progress(f"B={batch:>3} | warming up, then {repeats} timed run(s) on each of "
                     f"{len(sides)} sides ...")
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
            for r in range(repeats):
                job = {"prompts": prompts_for(model, batch, prompt_tokens, 1000 * batch + r),
                       "max_tokens": max_tokens}
                # Each turn starts one side later: a side that always ran after another
                # (its caches, its GPU context switched in) would carry that in every ratio.
                for name in names[r % len(names):] + names[:r % len(names)]:
                    runs[name].append(sides[name].run(job))
            row = {"batch": batch}
            for name, got in runs.items():
                row[name] = {key: median([g[key] for g in got]) for key in got[0]}
                row[name]["decode_tps_runs"] = [g["decode_tps"] for g in got]
            row["paired"] = paired_ratios(runs)
            rows.append(row)
            progress(render_row(row, list(sides)))
    finally:
        for side in sides.values():
            side.close()
    return {"model": str(model), "mlx_lm_model": str(theirs_model), "rows": rows,
            "sides": list(sides), "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "repeats": repeats, "machine": machine_info(), "runtime": runtime_info()}


def paired_ratios(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Each foretell side's decode tok/s over mlx-lm's (``x_mlx_lm``) and, for a drafting
    side, over plain foretell's (``x_plain``): the median of the ratios within each turn, the
    sides of one turn running one after the other, so a host whose speed drifts between
    turns moves both sides of a ratio alike (the ratio of the medians mixes turns); with
    each its 95% interval from those ratios (``..._ci``, :func:`paired_ratio_ci`; None
    below two turns): the single-request bench's pairing (:mod:`foretell.tools.measure`)."""
    def ratios(name: str, base: str, key: str) -> dict[str, Any]:
        return {key: paired_ratio(runs[name], runs[base], "decode_tps"),
                f"{key}_ci": paired_ratio_ci(runs[name], runs[base], "decode_tps")}

    out: dict[str, dict[str, Any]] = {}
    for name in runs:
        if name == "mlx-lm":
            continue
        out[name] = ratios(name, "mlx-lm", "x_mlx_lm")
        if name != PLAIN and PLAIN in runs:
            out[name].update(ratios(name, PLAIN, "x_plain"))
    return out


def render_row(row: dict[str, Any], sides: list[str]) -> str:
    paired = row.get("paired", {})
    cells = [f"B={row['batch']:>3}"]
    for name in sides:
        got = row[name]
        ratios = paired.get(name, {})
        ratio = f" ({_ratio(ratios, 'x_mlx_lm')}" if ratios.get("x_mlx_lm") else ""
        if ratios.get("x_plain"):
            ratio += f", {_ratio(ratios, 'x_plain')} plain"
        ratio += ")" if ratio else ""
        cells.append(f"{name}: {got['decode_tps']:7.1f} tok/s{ratio}, TTFT p50 "
                     f"{got['ttft_p50_s'] * 1e3:.0f} ms p99 {got['ttft_p99_s'] * 1e3:.0f} ms")
    return " | ".join(cells)


def _ratio(ratios: dict[str, Any], key: str) -> str:
    interval = ratios.get(f"{key}_ci")
    spread = f" [{interval[0]:.2f}-{interval[1]:.2f}]" if interval else ""
    return f"{ratios[key]:.2f}x{spread}"


def render(report: dict[str, Any]) -> str:
    lines = [f"batch decode, {report['prompt_tokens']}-token prompts, {report['max_tokens']} "
             f"tokens each, median of {report['repeats']}; mlx-lm on {report['mlx_lm_model']}"]
    lines += [render_row(row, report["sides"]) for row in report["rows"]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m foretell.tools.bench_batch")
    p.add_argument("--side", choices=("foretell", "mlx-lm"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--draft-model", default=None)
    p.add_argument("--k", type=int, default=3)
    return _worker(p.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
