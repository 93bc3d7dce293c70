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
  the rest (building the graph, per-row work, streaming); on foretell's side ``python``
  splits again into the scheduler's ``worker`` and the ``readers`` of its handles (one
  thread per request, as ``foretell bench --batch`` reads them).

``--drafts two-model,mtp`` adds a foretell side per drafter, every request speculating with
it (adaptive length up to 3, as ``foretell bench --batch``): the proxy's drafters have random
weights, so after its first probes the batch policy drafts nothing and the side measures what
rows carrying an idle drafter cost a plain step (its ratio is against plain foretell). The
two-model drafter is the proxy at 2 layers; the MTP head is one at the proxy's widths, written
beside the proxy's weights as the demo's is (``mtp_config`` in its config.json).

``--graph`` times a decode step's graph alone instead, with no scheduler and no threads:
the model's forward over a batch cache, the greedy draw and ``mx.async_eval``, per step the
host CPU to build the graph and to dispatch it, and its node count (on a GPU each node is a
kernel launch; the CPU's count is higher, its fast ops expanding into fallbacks). foretell's
batch rows of one length (``uniform``) and of two (``ragged``: rows that joined at different
times, as a wave of prompts longer than one prefill chunk does), mlx-lm's ``BatchKVCache``.

Attention takes the fused kernel on both sides (``FORETELL_ATTENTION=fused``, as a GPU's
decode step does) unless ``--attention`` says otherwise.

    python benchmarks/batch_host_cost.py --batches 1,4,16,32 --repeats 5 --json out.json
    python benchmarks/batch_host_cost.py --drafts two-model,mtp --sides foretell
    python benchmarks/batch_host_cost.py --graph --batches 16,32
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


def proxy_draft(model: Path, path: Path) -> Path:
    """The two-model drafter for the proxy: the proxy itself at 2 layers, other weights."""
    from foretell.tools.synthetic import make_model_dir

    config = json.loads((model / "config.json").read_text())
    keep = ("vocab_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
            "rope_theta", "tie_word_embeddings", "max_position_embeddings", "eos_token_id",
            "bos_token_id", *PROXY_SHAPE)
    overrides = {key: config[key] for key in keep} | {"num_hidden_layers": 2}
    make_model_dir(path, config["model_type"], overrides=overrides, seed=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(model / name, path / name)
    return path


def add_mtp_head(model: Path) -> None:
    """An MTP head at the proxy's widths (random weights) beside its weights, declared in its
    config.json as the demo declares its own."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import foretell
    from foretell_qwen.mtp import MTPHead

    head = MTPHead(foretell.load(str(model)).model.args)
    params = tree_flatten(head.parameters())
    keys = mx.random.split(mx.random.key(2), len(params))
    weights = {f"mtp.{name}": mx.ones(p.shape) if name.endswith("norm.weight")
               else mx.random.normal(p.shape, key=key) / p.shape[-1] ** 0.5
               for (name, p), key in zip(params, keys)}
    mx.save_safetensors(str(model / "mtp.safetensors"), weights)
    config = json.loads((model / "config.json").read_text())
    config["mtp_config"] = {"file": "mtp.safetensors", "prefix": "mtp."}
    (model / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


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
    """CPU seconds spent inside ``mx.eval`` and ``mx.async_eval``, on whichever thread, while
    entered: both engines call them through the module, so wrapping the module's functions
    sees all (put back on exit)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> EvalClock:
        import mlx.core as mx

        self._saved = mx.eval, mx.async_eval
        mx.eval, mx.async_eval = self._timed(mx.eval), self._timed(mx.async_eval)
        return self

    def __exit__(self, *exc: object) -> None:
        import mlx.core as mx

        mx.eval, mx.async_eval = self._saved

    def _timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            begin = time.thread_time()
            try:
                return call(*args)
            finally:
                self.seconds += time.thread_time() - begin
        return run


def thread_cpu_s(name: str) -> float:
    """CPU seconds the living threads called ``name`` have used (0 if there is none): each
    side's scheduler has a worker of that name, and only the running side's works."""
    total = 0
    for thread in threading.enumerate():
        if thread.name == name:
            stat = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text()
            total += int(stat.split()[0])
    return total / 1e9


def measure(model: Path, batches: list[int], repeats: int, prompt_tokens: int,
            max_tokens: int, names: list[str], drafts: dict[str, str | None] | None = None
            ) -> list[dict[str, Any]]:
    """Per B, each side's medians over ``repeats`` runs (see the module docstring)."""
    import foretell.scheduler as scheduler

    # The worker (and the MLX stream threads it made) must outlive every run: an MLX thread
    # that ends between two readings of python_cpu_s() would count as Python time.
    idle, running = scheduler.IDLE_EXIT_S, set(scheduler._LIVE)
    scheduler.IDLE_EXIT_S = 1e9
    try:
        with EvalClock() as clock:
            return _measure(clock, model, batches, repeats, prompt_tokens, max_tokens, names,
                            drafts or {})
    finally:
        scheduler.IDLE_EXIT_S = idle
        for made in set(scheduler._LIVE) - running:
            made.close()


def _measure(clock: EvalClock, model: Path, batches: list[int], repeats: int,
             prompt_tokens: int, max_tokens: int, names: list[str],
             drafts: dict[str, str | None]) -> list[dict[str, Any]]:
    from foretell.tools.bench_batch import _foretell_side, _mlx_lm_side, prompts_for
    from foretell.tools.measure import median

    make = {"foretell": lambda: _foretell_side(str(model), None, None, 3),
            "mlx-lm": lambda: _mlx_lm_side(str(model))}
    for draft, draft_model in drafts.items():
        make[f"foretell {draft}"] = lambda d=draft, m=draft_model: _foretell_side(
            str(model), d, m, 3)
    sides = {name: make[name]() for name in [*names, *(f"foretell {d}" for d in drafts)]}
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
                worker = thread_cpu_s("foretell-scheduler")
                got = run(prompts, max_tokens)
                host = 1e3 * (python_cpu_s() - cpu) / max_tokens
                worker = 1e3 * (thread_cpu_s("foretell-scheduler") - worker) / max_tokens
                evals = 1e3 * (clock.seconds - evals) / max_tokens
                figures = {"wall": 1e3 * batch / got["decode_tps"], "host": host,
                           "eval": evals, "python": host - evals}
                if name.startswith("foretell"):  # its worker makes every eval call
                    figures |= {"worker": worker - evals, "readers": host - worker}
                runs[name].append(figures)
        row: dict[str, Any] = {"batch": batch}
        for name, got in runs.items():
            row[name] = {key: median([g[key] for g in got]) for key in got[0]}
            row[name]["runs"] = got
        rows.append(row)
        print(render_row(row), flush=True)
    return rows


def graph_nodes(*outputs: Any) -> int:
    """Nodes (operations) in the unevaluated graph behind ``outputs``."""
    import re

    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return len(re.findall(r'shape=rectangle', dot.read()))


def measure_graphs(model: Path, batches: list[int], repeats: int,
                   prompt_tokens: int, steps: int = 40) -> list[dict[str, Any]]:
    """Per B: each kind of step's host CPU to build and to dispatch its graph (medians of
    ``repeats`` rounds of ``steps`` steps, the kinds taking turns) and its node count."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import BatchKVCache as TheirCache

    import foretell
    from foretell.model.batch import batch_caches
    from foretell.sampling import Sampler, draw_rows
    from foretell.tools.measure import median

    ours = foretell.load(str(model)).model
    theirs, _ = load(str(model))
    greedy = Sampler()

    def foretell_step(batch: int, ragged: bool) -> Callable[[mx.array], mx.array]:
        caches = batch_caches(ours)
        for cache, layer in zip(caches, zip(*(_prefilled(ours, prompt_tokens + b % 2 * ragged)
                                               for b in range(batch)))):
            cache.append(list(layer))
        rows = [(greedy, None, 0)] * batch
        return lambda tokens: draw_rows(ours.logits(ours.forward(tokens[:, None], caches)[0][
            :, -1, :]), rows)

    def mlx_lm_step(batch: int) -> Callable[[mx.array], mx.array]:
        caches = [TheirCache([0] * batch) for _ in theirs.layers]
        theirs(mx.zeros((batch, prompt_tokens), mx.int32), cache=caches)
        mx.eval([c.state for c in caches])

        def step(tokens: mx.array) -> mx.array:
            logits = theirs(tokens[:, None], cache=caches)[:, -1, :]
            return mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        return step

    kinds: dict[str, Callable[[int], Callable[[mx.array], mx.array]]] = {
        "foretell uniform": lambda b: foretell_step(b, False),
        "foretell ragged": lambda b: foretell_step(b, True),
        "mlx-lm": mlx_lm_step,
    }
    rows = []
    for batch in batches:
        got: dict[str, list[tuple[float, float]]] = {kind: [] for kind in kinds}
        nodes = {}
        for r in range(repeats):
            order = list(kinds.items())
            for kind, make in order if r % 2 == 0 else order[::-1]:
                step, tokens = make(batch), mx.zeros((batch,), mx.int32)
                build, dispatch = [], []
                for i in range(steps):
                    begin = time.thread_time()
                    drawn = step(tokens)
                    built = time.thread_time()
                    if i == steps // 2:
                        nodes[kind] = graph_nodes(drawn)
                    built_after_count = time.thread_time()
                    mx.async_eval(drawn)
                    dispatch.append(time.thread_time() - built_after_count)
                    build.append(built - begin)
                    mx.eval(drawn)
                    tokens = drawn
                got[kind].append((median(build[5:]), median(dispatch[5:])))
        row: dict[str, Any] = {"batch": batch}
        for kind, times in got.items():
            build_ms = 1e3 * median([t[0] for t in times])
            dispatch_ms = 1e3 * median([t[1] for t in times])
            row[kind] = {"build_ms": build_ms, "dispatch_ms": dispatch_ms,
                         "host_ms": build_ms + dispatch_ms, "nodes": nodes[kind]}
        rows.append(row)
        print(f"B={batch:>3} " + "  ".join(
            f"{kind}: {row[kind]['host_ms']:.2f} ms (build {row[kind]['build_ms']:.2f} + "
            f"dispatch {row[kind]['dispatch_ms']:.2f}), {row[kind]['nodes']} nodes"
            for kind in kinds), flush=True)
    return rows


def _prefilled(model: Any, tokens: int) -> list[Any]:
    import mlx.core as mx

    caches = model.make_caches()
    model.forward(mx.zeros((1, tokens), mx.int32), caches)
    mx.eval([c.state for c in caches])
    return caches


def render_row(row: dict[str, Any]) -> str:
    """Plain foretell against mlx-lm, then each drafter's side against plain foretell."""
    lines = [_render_pair(row["batch"], row.get("foretell"), row.get("mlx-lm"), "mlx-lm")]
    for name in [n for n in row if n.startswith("foretell ")]:
        lines.append(_render_pair(row["batch"], row[name], row.get("foretell"), "foretell",
                                  name.removeprefix("foretell ")))
    return "\n".join(lines)


def _render_pair(batch: int, ours: dict[str, Any] | None, theirs: dict[str, Any] | None,
                 against: str, draft: str | None = None) -> str:
    cells = [f"B={batch:>3}{f' {draft}' if draft else ''} ms/step"]
    for key in ("wall", "host", "python", "eval"):
        got = [f"{side[key]:6.2f}" for side in (ours, theirs) if side is not None]
        ratio = f" ({ours[key] / theirs[key]:.2f}x)" if ours and theirs else ""
        cells.append(f"{key} {' / '.join(got)}{ratio}")
    if ours is not None:
        cells.append(f"(foretell's python: worker {ours['worker']:.2f} readers "
                     f"{ours['readers']:.2f})")
    name = f"foretell {draft}" if draft else "foretell"
    return "  ".join(cells) + (f"   ({name} / {against})" if ours and theirs else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,4,16,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--attention", default="fused",
                   help="FORETELL_ATTENTION for foretell's side (mlx-lm always fuses)")
    p.add_argument("--sides", default="foretell,mlx-lm")
    p.add_argument("--drafts", default="",
                   help="two-model,mtp: a foretell side speculating with each (see above)")
    p.add_argument("--graph", action="store_true",
                   help="time a decode step's graph alone (see the module docstring)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    os.environ["FORETELL_ATTENTION"] = args.attention
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from foretell.platform import blas

    blas.preload()  # before mlx is imported: both engines on the optimized BLAS
    from foretell.tools.measure import machine_info, portable, runtime_info

    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = proxy_model(Path(tmp) / "proxy")
        drafts: dict[str, str | None] = {}
        for draft in filter(None, args.drafts.split(",")):
            if draft == "two-model":
                drafts[draft] = str(proxy_draft(model, Path(tmp) / "proxy-draft"))
            elif draft == "mtp":
                add_mtp_head(model)
                drafts[draft] = None
            else:
                p.error(f"--drafts: unknown drafter {draft!r} (two-model, mtp)")
        batches = [int(b) for b in args.batches.split(",")]
        if args.graph:
            rows = measure_graphs(model, batches, args.repeats, args.prompt_tokens)
        else:
            rows = measure(model, batches, args.repeats, args.prompt_tokens,
                           args.max_tokens, list(filter(None, args.sides.split(","))), drafts)
    if args.json is not None:
        args.json.write_text(json.dumps(portable({
            "proxy": {"of": "demo", **PROXY_SHAPE, "dtype": "float32"},
            "graph": args.graph, "drafts": list(drafts), "attention": args.attention,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
            "load_avg_before_after": [load, os.getloadavg()], "machine": machine_info(),
            "runtime": runtime_info(),
        }), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
