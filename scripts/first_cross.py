"""One fresh request drafting past 1,024 tokens: its longest wait and the fixed-shape traces
(H200 question, not a test). On the H200 (2026-12-03 13:34) a sampled MTP request that
first drafted past 1,024 tokens in its process waited 29.6 s once, with 12 traces.

    python scripts/first_cross.py TEMP [--no-fixed]   # greedy at TEMP 0
"""

from __future__ import annotations

import argparse
import contextlib
import time

import foretell
from foretell.config import SamplingConfig
from foretell.model import fixed
from foretell.spec import make_speculator
from foretell.spec.bench import code_prompts
from foretell.spec.warmup import ScriptedPolicy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("temp", type=float)
    ap.add_argument("--no-fixed", action="store_true")
    args = ap.parse_args()
    engine = foretell.load("demo")
    prompt = code_prompts(engine.tokenizer, 992)["code"]
    speculate = make_speculator(engine.registry, engine.target, "mtp")
    object.__setattr__(speculate, "policy", ScriptedPolicy(6, [3, 3, 3, 3, 0] * 200))
    sampling = SamplingConfig(temp=args.temp, seed=0) if args.temp > 0 else None
    mode = fixed.forced("off") if args.no_fixed else contextlib.nullcontext()
    stamps, traces = [time.perf_counter()], fixed.trace_count()
    with mode:
        for event in engine.generate(prompt, max_tokens=256, ignore_eos=True, sampling=sampling,
                                     speculate=speculate):
            if event.type == "text" and event.tokens:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # after the first token
    at = max(range(len(gaps)), key=gaps.__getitem__)
    print(f"temp {args.temp} fixed {'off' if args.no_fixed else 'on'}: "
          f"{(len(stamps) - 2) / (stamps[-1] - stamps[1]):.1f} tok/s, longest wait "
          f"{gaps[at] * 1e3:.0f} ms after text event {at + 1}, traces {fixed.trace_count() - traces}",
          flush=True)


if __name__ == "__main__":
    main()
