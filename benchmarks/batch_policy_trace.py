"""What the batch draft policy chose and timed, step by step, on this device.

    python benchmarks/batch_policy_trace.py [--drafts none,two-model,mtp] [--batches 4,32]
                                            [--repeats 3] [--json FILE]

Each drafter runs B demo requests (128-token prompts, 64 tokens, greedy) through
``foretell bench --batch``'s foretell side, the policy kept across runs as the bench keeps it.
Printed per run: decode tok/s and the widest draft of every step (0: a plain step); the JSON
keeps every ``choose`` (rows, width, mean acceptance estimate) and ``observe`` (rows, width,
ms or None: untimed). It tells a policy that drafts too much from rows that lose while not
drafting. Numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator, Sequence

from foretell.platform import blas


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

    bp.BatchDraftPolicy.choose, bp.BatchDraftPolicy.observe = choosing, observing
    try:
        yield
    finally:
        bp.BatchDraftPolicy.choose, bp.BatchDraftPolicy.observe = choose, observe


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
    with traced(trace):
        for draft in args.drafts.split(","):
            drafter = None if draft == "none" else draft
            run = _foretell_side(str(model), drafter,
                                 draft_model if drafter == "two-model" else None, 4)
            for batch in (int(b) for b in args.batches.split(",")):
                for r in range(args.repeats):
                    trace.clear()
                    got = run(prompts_for(model, batch, args.prompt_tokens, 1000 * batch + r),
                              args.max_tokens)
                    report[f"{draft} B={batch} #{r}"] = {"summary": got, "trace": list(trace)}
                    widths = "".join(str(t[2]) for t in trace if t[0] == "choose")
                    print(f"{draft:>9} B={batch:<3} #{r}  {got['decode_tps']:9.1f} tok/s  "
                          f"widths {widths or '-'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
