"""Rows taking turns in one process, each paired with a baseline row (the A/B scripts'
shared loop: ``mtp_off_ab.py``, ``plain_after_draft.py``, ``writer_ab.py``).

Each row runs once as a warm-up, then ``rounds`` times, the order flipping every round so a
drifting host hits every row alike; a row's paired median is the median of its ratios to
the baseline's run of the same round. Decode speed is timed as ``foretell bench`` times it
(:func:`foretell.tools.bench.time_run`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any


def decode_tps(events: Iterable[Any]) -> float:
    """Tokens after the first text event over the time after it, from ``generate``'s events."""
    from foretell.tools.bench import time_run

    def steps() -> Iterator[int]:
        for event in events:
            if event.type == "text" and event.tokens:
                yield len(event.tokens)

    return time_run(steps(), 0).decode_tps


def take_turns(rows: Sequence[str], run: Callable[[str, int], float], rounds: int,
               baseline: str, out_name: str) -> dict[str, Any]:
    """``run(row, seed)`` returns tok/s; prints each round, writes ``$OUT/out_name`` (default
    /tmp) and returns per row the median tok/s, the paired median and every run."""
    for row in rows:
        start = time.perf_counter()
        run(row, 0)
        print("warm-up", row, f"{time.perf_counter() - start:.1f} s", flush=True)
    runs: dict[str, list[float]] = {row: [] for row in rows}
    for index in range(rounds):
        for row in rows if index % 2 == 0 else rows[::-1]:
            runs[row].append(run(row, index + 1))
        print(index, {row: round(found[-1], 1) for row, found in runs.items()}, flush=True)
    width = max(len(row) for row in rows) + 1
    report = {}
    for row in rows:
        paired = statistics.median(a / b for a, b in zip(runs[row], runs[baseline]))
        report[row] = {"median_tps": statistics.median(runs[row]), "paired_median": paired,
                       "runs": runs[row]}
        print(f"{row:{width}s} {report[row]['median_tps']:8.1f} tok/s  paired {paired:.3f}")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), out_name), "w") as out:
        json.dump(report, out, indent=1)
    return report


def demo_probe(default_rounds: int) -> tuple[Any, Any, list[int], dict[str, Any]]:
    """The probes' shared start: ``ROUNDS`` and ``--temp`` (default 0.8) from the command
    line, the demo engine, its 992-token code prompt and a speculator per model drafter
    (``mtp``, ``two-model``, without the warm-up). Returns ``(args, engine, prompt,
    speculators)``."""
    import argparse

    import foretell
    from foretell.spec import make_speculator
    from foretell.spec.bench import code_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=default_rounds)
    ap.add_argument("--temp", type=float, default=0.8)
    args = ap.parse_args()
    engine = foretell.load("demo")
    prompt = code_prompts(engine.tokenizer, 992)["code"]
    speculators = {kind: make_speculator(engine.registry, engine.target, kind)
                   for kind in ("mtp", "two-model")}
    return args, engine, prompt, speculators
