"""What the batch draft policy chose and timed, step by step, on this device.

    python benchmarks/batch_policy_trace.py [--drafts none,two-model,mtp] [--batches 4,32]
                                            [--repeats 3] [--json FILE]

Each drafter runs B demo requests (128-token prompts, 64 tokens, greedy) through
``foretell bench --batch``'s foretell side, the policy kept across runs as the bench keeps it;
the drafters take turns in one process, each turn starting one later. Printed per run: decode
tok/s, the median timed step, the garbage collector's pauses and the widest draft of every
step (0: a plain step); the JSON keeps every ``choose`` (rows, width, mean acceptance
estimate) and ``observe`` (rows, width, ms or None: untimed). It tells a policy that drafts
too much from rows that lose while not drafting. Numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import time
from collections.abc import Iterator, Sequence
from unittest import mock

from foretell.platform import blas


@contextlib.contextmanager
def gc_paused() -> Iterator[list[float]]:
    """Seconds of each garbage collection while inside (a pause on the engine's thread is a
    pause of every row)."""
    pauses: list[float] = []
    began = [0.0]

    def timing(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - began[0])

    gc.callbacks.append(timing)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(timing)


@contextlib.contextmanager
def traced(trace: list[list]) -> Iterator[None]:
    """Record the batch policy's choices and timings into ``trace`` while inside."""
    from foretell.spec import batch_policy as bp

    choose, observe = bp.BatchDraftPolicy.choose, bp.BatchDraftPolicy.observe

    def choosing(self, caps, rates, top=None, draining=None, dormant=0):
        widths = choose(self, caps, rates, top, draining, dormant)
        known = [r for r in rates if r is not None]
        trace.append(["choose", len(rates), max(widths, default=0),
                      round(sum(known) / len(known), 3) if known else None])
        return widths

    def observing(self, rows, width, seconds):
        trace.append(["observe", rows, width, None if seconds is None else seconds * 1e3])
        return observe(self, rows, width, seconds)

    with mock.patch.object(bp.BatchDraftPolicy, "choose", choosing), \
            mock.patch.object(bp.BatchDraftPolicy, "observe", observing):
        yield


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft-model", default="demo-draft")
    ap.add_argument("--drafts", default="none,two-model,mtp")
    ap.add_argument("--batches", default="4,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    blas.preload()
    from foretell.cli.run_cmd import model_path
    from foretell.tools.bench_batch import _foretell_side, prompts_for

    model = model_path(args.model, "--model")
    draft_model = str(model_path(args.draft_model, "--draft-model"))
    report: dict[str, dict] = {}
    trace: list[list] = []
    drafts = args.drafts.split(",")
    runs = {draft: _foretell_side(str(model), None if draft == "none" else draft,
                                  draft_model if draft == "two-model" else None, 4)
            for draft in drafts}
    with traced(trace), gc_paused() as paused:
        for batch in (int(b) for b in args.batches.split(",")):
            for r in range(args.repeats):
                # Each turn one drafter later: the host's drift falls on every side alike.
                for draft in drafts[r % len(drafts):] + drafts[:r % len(drafts)]:
                    trace.clear()
                    paused.clear()
                    got = runs[draft](prompts_for(model, batch, args.prompt_tokens,
                                                  1000 * batch + r), args.max_tokens)
                    timed = sorted(t[3] for t in trace if t[0] == "observe" and t[3] is not None)
                    step_ms = timed[len(timed) // 2] if timed else None
                    report[f"{draft} B={batch} #{r}"] = {
                        "summary": got, "trace": list(trace), "step_ms_median": step_ms,
                        "gc_ms": sum(paused) * 1e3, "gc_collections": len(paused)}
                    widths = "".join(str(t[2]) for t in trace if t[0] == "choose")
                    print(f"{draft:>9} B={batch:<3} #{r}  {got['decode_tps']:9.1f} tok/s  "
                          f"step {step_ms or 0:6.3f} ms  gc {sum(paused) * 1e3:5.1f} ms "
                          f"({len(paused)})  widths {widths or '-'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
