"""A lone request through the batch scheduler against the same request through
``Engine.generate``, plain and speculating, paired turn by turn in one process.

    python benchmarks/lone_request.py [--draft two-model|mtp|...] [--repeats 8]
                                      [--max-tokens 64] [--prompt-tokens 128] [--json FILE]

A server runs every request through the scheduler (``foretell serve``), ``foretell run`` and
a library's ``generate`` through the engine's own loop: a request alone must decode as fast
either way, plain and with a drafter (issue 44: single-request figures within 3%). Each turn
runs the four ways on one demo prompt (greedy, ``ignore_eos``), in an order that rotates a
way a turn; decode tok/s counts the tokens after the first over the time after it. Printed:
each turn, then the paired ratios as ``foretell bench`` pairs its sides (the median of the
turns' ratios, with a 95% interval: ``foretell.tools.measure``). Numbers only, never
assertions.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from foretell.platform import blas

WAYS = ("generate plain", "generate drafting", "scheduler plain", "scheduler drafting")
#: The ratios printed: (name, numerator way, denominator way).
RATIOS = (("drafting / plain, generate", "generate drafting", "generate plain"),
          ("drafting / plain, scheduler", "scheduler drafting", "scheduler plain"),
          ("scheduler / generate, plain", "scheduler plain", "generate plain"),
          ("scheduler / generate, drafting", "scheduler drafting", "generate drafting"))


def decode_tps(events: Iterable[Any]) -> float:
    """Tokens after the first over the seconds after the first came (0 below two tokens)."""
    first, count = None, 0
    for event in events:
        if event.type == "text" and event.tokens:
            if first is None:
                first = time.perf_counter()
            count += len(event.tokens)
    if first is None or count < 2:
        return 0.0
    return (count - 1) / max(time.perf_counter() - first, 1e-9)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default="two-model")
    ap.add_argument("--draft-model", default="demo-draft", help="for --draft two-model")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    blas.preload()
    import foretell
    from foretell.cli.run_cmd import model_path
    from foretell.scheduler import Scheduler
    from foretell.tools.bench_batch import prompts_for, use_drafter
    from foretell.tools.measure import paired_ratio, paired_ratio_ci

    model = str(model_path(args.model, "--model"))
    engine = foretell.load(model)
    use_drafter(engine, args.draft, str(model_path(args.draft_model, "--draft-model")))
    scheduler = Scheduler(engine)

    options = {"max_tokens": args.max_tokens, "ignore_eos": True, "chat": False}

    def start(way: str, prompt: list[int]) -> Iterable[Any]:
        """One way's request: its events as they stream."""
        drafting = way.endswith("drafting")
        if way.startswith("generate"):
            return engine.generate(prompt, speculate=drafting, **options)
        return scheduler.submit(prompt, speculate=drafting, **options)

    got: dict[str, list[float]] = {way: [] for way in WAYS}
    try:
        for turn in range(args.repeats + 1):  # the first turn warms every way, untimed
            prompt = prompts_for(model, 1, args.prompt_tokens, 500 + turn)[0]
            order = WAYS[turn % len(WAYS):] + WAYS[:turn % len(WAYS)]
            speeds = {way: decode_tps(start(way, prompt)) for way in order}
            if turn:
                for way in WAYS:
                    got[way].append(speeds[way])
                print(f"turn {turn:>2}  " + "  ".join(f"{way} {speeds[way]:8.1f}"
                                                      for way in WAYS), flush=True)
    finally:
        scheduler.close()
    report: dict[str, Any] = {"draft": args.draft, "max_tokens": args.max_tokens,
                              "prompt_tokens": args.prompt_tokens, "tok_s": got, "ratios": {}}
    for name, top, bottom in RATIOS:
        ours, theirs = ([{"tps": x} for x in got[way]] for way in (top, bottom))
        ratio = paired_ratio(ours, theirs, "tps")
        interval = paired_ratio_ci(ours, theirs, "tps")
        report["ratios"][name] = {"ratio": ratio, "ci": interval}
        if ratio is not None:
            print(f"{name}: {ratio:.3f}x" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]"
                                             if interval else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
