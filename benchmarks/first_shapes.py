"""What a batch's first meeting with each row count costs on this device: B demo requests at
once through the scheduler, for B = 1..N, twice over in one process.

    python benchmarks/first_shapes.py [--rows 24] [--prompt-tokens 128] [--json FILE]

Where the device compiles kernels or builds a graph per shape (MLX-CUDA), a row count's first
plain step and a shared prefill's first of its shape cost more than the same work met again,
and the first burst of requests that reaches a row count pays it (TTFT at 16 concurrent
clients, docs/benchmarks.md, "Serving"). Printed per B and sweep: the slowest plain step over
B rows, the shared prefill and the whole run; the second sweep meets every shape again.
Then three sweeps of ragged prompts (96-128 tokens) at B = 4, 8, 16: new prefill shapes over
row counts already met. Numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

from foretell.platform import blas

#: Scheduler methods timed, and the name each is reported under.
TIMED = {"_plain_step": "plain_step", "_prefill_together": "shared_prefill"}


@contextlib.contextmanager
def timed_steps(record: list[tuple[str, int, float]]) -> Iterator[None]:
    """Record ``(name, rows running, ms)`` for each call of :data:`TIMED` while inside;
    the methods put back as found after (``mock.patch.object`` leaves no copy of an
    inherited method on ``Scheduler``, where it would hide later patches of its base)."""
    from foretell.scheduler import Scheduler

    def timing(name: str) -> Any:
        method = getattr(Scheduler, name)

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            rows, started = len(self._rows), time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                record.append((TIMED[name], rows, (time.perf_counter() - started) * 1e3))
        return timed

    with contextlib.ExitStack() as patches:
        for name in TIMED:
            patches.enter_context(mock.patch.object(Scheduler, name, timing(name)))
        yield


def run_batch(scheduler: Any, prompts: list[list[int]]) -> float:
    """Decode ``prompts`` at once, 6 tokens each; the run's wall milliseconds."""
    from foretell.stream import merged

    started = time.perf_counter()
    handles = [scheduler.submit(p, max_tokens=6, ignore_eos=True, chat=False, speculate=False)
               for p in prompts]
    for _ in merged(handles):
        pass
    return (time.perf_counter() - started) * 1e3


def summary(record: list[tuple[str, int, float]], rows: int, wall: float) -> dict[str, Any]:
    """The slowest plain step over ``rows`` rows, the shared prefills' times and the wall."""
    by: dict[str, list[float]] = collections.defaultdict(list)
    for name, running, ms in record:
        if name != "plain_step" or running == rows:
            by[name].append(ms)
    return {"rows": rows, "wall_ms": wall,
            "plain_step_max_ms": max(by["plain_step"], default=None),
            "shared_prefill_ms": by["shared_prefill"]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--rows", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    blas.preload()
    import foretell
    from foretell.cli.run_cmd import model_path
    from foretell.scheduler import Scheduler
    from foretell.tools.bench_batch import prompts_for

    model = str(model_path(args.model, "--model"))
    engine = foretell.load(model)
    engine.cache = None
    scheduler = Scheduler(engine, max_rows=max(args.rows, 16))
    report: dict[str, list[dict[str, Any]]] = {"sweeps": [], "ragged": []}
    record: list[tuple[str, int, float]] = []
    rng = random.Random(5)

    def show(label: str, row: dict[str, Any]) -> None:
        prefill = ", ".join(f"{ms:.1f}" for ms in row["shared_prefill_ms"]) or "-"
        step = row["plain_step_max_ms"]
        print(f"{label} B={row['rows']:<3} slowest plain step "
              f"{'-' if step is None else f'{step:8.2f}'} ms  shared prefill {prefill} ms  "
              f"run {row['wall_ms']:8.1f} ms", flush=True)

    try:
        with timed_steps(record):
            for sweep in range(2):
                for rows in range(1, args.rows + 1):
                    record.clear()
                    prompts = prompts_for(model, rows, args.prompt_tokens, 7 * rows + sweep)
                    row = summary(record, rows, run_batch(scheduler, prompts))
                    row["sweep"] = sweep
                    report["sweeps"].append(row)
                    show(f"sweep {sweep}", row)
            for sweep in range(3):
                for rows in (4, 8, 16):
                    record.clear()
                    lo = max(1, args.prompt_tokens * 3 // 4)
                    prompts = [p[: rng.randint(lo, args.prompt_tokens)] for p in
                               prompts_for(model, rows, args.prompt_tokens, 99 * rows + sweep)]
                    row = summary(record, rows, run_batch(scheduler, prompts))
                    row["sweep"] = sweep
                    report["ragged"].append(row)
                    show(f"ragged {sweep}", row)
    finally:
        scheduler.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
