"""The batch step's host cost: foretell's scheduler against mlx-lm's ``BatchGenerator`` on a
model whose compute is small, so what differs between the two is host work (Python and graph
building per row and per layer).

On a GPU a large batch's step is host-bound (docs/benchmarks.md, "Many requests at once");
this measures that work on any machine. The proxy is the demo's architecture (its layer
count, vocabulary, head layout and tokenizer) with tiny widths and random weights, written
once as a model directory both engines load. Both sides run in this one process through
``foretell bench --batch``'s own runners (:mod:`foretell.tools.bench_batch`), taking turns
on the same prompts at each B. Per decode step, medians over the repeats:

- ``wall``: the B rows' tokens after each one's first, over the time from the last first
  token to the last token (on a CPU mostly the attention's compute);
- ``host``: CPU time of the process's Python threads (the scheduler's worker and the
  readers of its handles; mlx-lm's loop), over the run, per step. MLX's compute threads are
  not counted. It splits into ``eval``, the CPU time inside ``mx.eval`` / ``mx.async_eval``
  calls (MLX walking and dispatching the graph: a GPU's kernel launches), and ``python``,
  the rest (building the graph, per-row work, streaming).

Attention takes the fused kernel on both sides (``FORETELL_ATTENTION=fused``, as a GPU's
decode step does) unless ``--attention`` says otherwise.

    python benchmarks/batch_host_cost.py --batches 1,4,16,32 --repeats 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO = Path(__file__).resolve().parents[1] / "core" / "foretell" / "demo" / "demo"

#: The demo's shape with every width cut down: its layers, vocabulary and heads.
PROXY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 64}


def proxy_model(path: Path) -> Path:
    """The demo's architecture at tiny widths with random weights (float32), and the demo's
    tokenizer, so detokenizing costs what it costs on the demo."""
    from foretell.tools.synthetic import make_model_dir

    demo = json.loads((DEMO / "config.json").read_text())
    keep = ("num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings", "max_position_embeddings",
            "eos_token_id", "bos_token_id")
    overrides = {key: demo[key] for key in keep} | PROXY_SHAPE
    make_model_dir(path, demo["model_type"], overrides=overrides, seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        shutil.copy(DEMO / name, path / name)
    return path


def python_cpu_s() -> float:
    """CPU seconds this process's Python threads have used, living or ended: the process's
    total less what its other threads (MLX's compute streams) used."""
    python = {t.native_id for t in threading.enumerate()}
    others = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in python:
            try:
                others += int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, ValueError):  # the thread ended meanwhile
                pass
    return time.process_time() - others / 1e9


class EvalClock:
    """CPU seconds spent inside ``mx.eval`` and ``mx.async_eval``, on whichever thread:
    both engines call them through the module, so wrapping the module's functions sees all."""

    def __init__(self) -> None:
        import mlx.core as mx

        self.seconds = 0.0
        mx.eval, mx.async_eval = self._timed(mx.eval), self._timed(mx.async_eval)

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            begin = time.thread_time()
            try:
                return call(*args)
            finally:
                self.seconds += time.thread_time() - begin
        return run


def measure(model: Path, batches: list[int], repeats: int, prompt_tokens: int,
            max_tokens: int) -> list[dict[str, Any]]:
    import foretell.scheduler
    from foretell.tools.bench_batch import _foretell_side, _mlx_lm_side, prompts_for
    from foretell.tools.measure import median

    # The worker (and the MLX stream threads it made) must outlive every run: an MLX thread
    # that ends between two readings of python_cpu_s() would count as Python time.
    foretell.scheduler.IDLE_EXIT_S = 1e9
    clock = EvalClock()
    sides = {"foretell": _foretell_side(str(model), None, None, 3),
             "mlx-lm": _mlx_lm_side(str(model))}
    rows = []
    for batch in batches:
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for run in sides.values():  # untimed: shapes new to the process
            run(prompts_for(model, batch, prompt_tokens, batch), 4)
        for r in range(repeats):
            prompts = prompts_for(model, batch, prompt_tokens, 1000 * batch + r)
            order = list(sides.items())
            for name, run in order if r % 2 == 0 else order[::-1]:
                cpu, evals = python_cpu_s(), clock.seconds
                got = run(prompts, max_tokens)
                host = 1e3 * (python_cpu_s() - cpu) / max_tokens
                evals = 1e3 * (clock.seconds - evals) / max_tokens
                runs[name].append({"wall": 1e3 * batch / got["decode_tps"], "host": host,
                                   "eval": evals, "python": host - evals})
        row: dict[str, Any] = {"batch": batch}
        for name, got in runs.items():
            row[name] = {key: median([g[key] for g in got]) for key in got[0]}
            row[name]["runs"] = got
        rows.append(row)
        print(render_row(row), flush=True)
    return rows


def render_row(row: dict[str, Any]) -> str:
    ours, theirs = row["foretell"], row["mlx-lm"]
    cells = [f"B={row['batch']:>3} ms/step"]
    for key in ("wall", "host", "python", "eval"):
        cells.append(f"{key} {ours[key]:6.2f} / {theirs[key]:6.2f} "
                     f"({ours[key] / theirs[key]:.2f}x)")
    return "  ".join(cells) + "   (foretell / mlx-lm)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--attention", default="fused",
                   help="FORETELL_ATTENTION for foretell's side (mlx-lm always fuses)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    os.environ["FORETELL_ATTENTION"] = args.attention
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from foretell.platform import blas

    blas.preload()  # before mlx is imported: both engines on the optimized BLAS
    from foretell.tools.measure import machine_info, runtime_info

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = proxy_model(Path(tmp) / "proxy")
        rows = measure(model, [int(b) for b in args.batches.split(",")], args.repeats,
                       args.prompt_tokens, args.max_tokens)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "proxy": {"of": "demo", **PROXY_SHAPE, "dtype": "float32"},
            "attention": args.attention, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
            "load_avg_before_after": [load, os.getloadavg()], "machine": machine_info(),
            "runtime": runtime_info(),
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
