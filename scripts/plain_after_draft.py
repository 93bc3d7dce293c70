"""Do plain steps slow down once a request has drafted? (H200 question, not a test.)

On the H200 (2026-12-03) sampled MTP requests that drafted a little decoded at 0.60x plain
(mean k 0.29) and the policy timed their plain steps at 1.85 ms against plain decoding's
1.14 ms, while the same speculator pinned to plain steps from the start ran at parity
(``scripts/mtp_off_ab.py``). This runs, paired, at a new prompt length each run:

- ``plain``: plain decoding;
- ``K-off``: the speculator ``K`` (mtp, two-model) on plain steps from the first token;
- ``K-3-off``: the same after three drafted rounds of 2 tokens at the start;
- ``mtp-3-off-nofixed``: as ``mtp-3-off`` with the verifier's fixed-shape forwards off.

    python scripts/plain_after_draft.py [ROUNDS] [--temp T]   # $OUT/plain-after-draft.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import foretell
from foretell.config import SamplingConfig
from foretell.model import fixed
from foretell.spec import make_speculator
from foretell.spec.bench import code_prompts
from foretell.spec.warmup import ScriptedPolicy

ROWS = ("plain", "mtp-off", "mtp-3-off", "mtp-3-off-nofixed", "two-model-off", "two-model-3-off")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=11)
    ap.add_argument("--temp", type=float, default=0.8)
    args = ap.parse_args()
    engine = foretell.load("demo")
    prompt = code_prompts(engine.tokenizer, 992)["code"]
    speculators = {kind: make_speculator(engine.registry, engine.target, kind)
                   for kind in ("mtp", "two-model")}
    dropped = [0]

    def run(row: str, seed: int) -> float:
        dropped[0] += 1  # a new prompt length every run
        speculate: object = False
        if row != "plain":
            kind = row.split("-")[0] if not row.startswith("two-model") else "two-model"
            speculate = speculators[kind]
            script = ([2, 2, 2] if "-3-" in row else []) + [0] * 400
            object.__setattr__(speculate, "policy", ScriptedPolicy(6, script))
        mode = fixed.forced("off") if row.endswith("nofixed") else contextlib.nullcontext()
        first = last = None
        count = 0
        sampling = SamplingConfig(temp=args.temp, seed=seed) if args.temp > 0 else None
        with mode:
            for event in engine.generate(prompt[: len(prompt) - dropped[0]], max_tokens=256,
                                         ignore_eos=True, sampling=sampling, speculate=speculate):
                if event.type == "text" and event.tokens:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        count += len(event.tokens)
                    last = now
        return count / (last - first)

    for row in ROWS:
        start = time.perf_counter()
        run(row, 0)
        print("warm-up", row, f"{time.perf_counter() - start:.1f} s", flush=True)
    runs: dict[str, list[float]] = {row: [] for row in ROWS}
    for index in range(args.rounds):
        for row in ROWS if index % 2 == 0 else ROWS[::-1]:
            runs[row].append(run(row, index + 1))
        print(index, {row: round(found[-1], 1) for row, found in runs.items()}, flush=True)
    report = {}
    for row in ROWS:
        paired = statistics.median(a / b for a, b in zip(runs[row], runs["plain"]))
        report[row] = {"median_tps": statistics.median(runs[row]), "paired_median": paired,
                       "runs": runs[row]}
        print(f"{row:18s} {report[row]['median_tps']:8.1f} tok/s  paired {paired:.3f}")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "plain-after-draft.json"), "w") as out:
        json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
