"""Fixed draft widths against plain batching and the adaptive batch policy (not a test).

    python benchmarks/batch_widths.py [--batch 2] [--repeats 15] [--widths 1,2,3]
                                      [--draft two-model] [--with-width-one]

B demo requests (128-token prompts, 64 tokens, greedy) through one engine's scheduler, once a
side and turn: plain rows; rows drafting under the adaptive policy; with ``--with-width-one``
the policy again with width 1 among its candidates (it weighs 0, top / 2 and top); and each
fixed width (every row drafts that many tokens every step it can). The sides rotate each turn,
one untimed turn first. Printed per side: median decode tok/s after the first token and the
median of the turns' ratios to plain, with every turn's ratio. What the policy leaves on the
table against the best fixed width on this machine; numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from foretell.platform import blas


def fixed_width(width: int):
    """A ``choose`` drafting ``width`` tokens on every row that can, from its first step."""
    from foretell.spec.batch_policy import _lengths

    def choose(caps, rates, top=None, draining=None, dormant=0):
        caps = caps() if callable(caps) else caps
        return _lengths(width, caps, rates) if max(caps, default=0) else [0] * len(rates)

    return choose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--widths", default="1,2,3", help="fixed widths ('' for none)")
    parser.add_argument("--draft", default="two-model")
    parser.add_argument("--draft-model", default="demo-draft")
    parser.add_argument("--with-width-one", action="store_true")
    args = parser.parse_args()
    blas.preload()
    import foretell
    from foretell.engine import resolve_model_path
    from foretell.scheduler import Scheduler
    from foretell.tools.bench_batch import prompts_for, run_requests, use_drafter

    engine = foretell.load("demo")
    draft_model = args.draft_model if args.draft == "two-model" else None
    speculator = use_drafter(engine, args.draft, draft_model, max_tokens=4)
    sides: dict[str, tuple[Any, Any]] = {"plain": (Scheduler(engine, max_rows=64), False),
                                         "policy": (Scheduler(engine, max_rows=64), speculator)}
    if args.with_width_one:
        scheduler = Scheduler(engine, max_rows=64)
        scheduler._policy.widths = lambda top: sorted({0, 1, max(1, top // 2), top}) \
            if top else [0]
        sides["policy+1"] = (scheduler, speculator)
    for width in [int(w) for w in args.widths.split(",") if w]:
        scheduler = Scheduler(engine, max_rows=64)
        scheduler._policy.choose = fixed_width(width)
        sides[f"width {width}"] = (scheduler, speculator)
    model, rows = resolve_model_path("demo"), args.batch
    runs: dict[str, list[float]] = {name: [] for name in sides}
    for turn in range(args.repeats + 1):
        prompts = prompts_for(model, rows, 128, 100 + turn)
        names = list(sides)
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            scheduler, speculate = sides[name]
            got = run_requests(scheduler, prompts, 64, speculate)
            if turn:
                runs[name].append(got["decode_tps"])
    for name, speeds in runs.items():
        ratios = [a / p for a, p in zip(speeds, runs["plain"])]
        print(f"B={rows} {name:9s} {statistics.median(speeds):7.1f} tok/s  x plain "
              f"{statistics.median(ratios):.3f}  {sorted(round(r, 2) for r in ratios)}")


if __name__ == "__main__":
    main()
