"""What a plain stretch between drafted rounds costs, step by step (H200 question, not a test).

On the H200 (2026-12-03 12:35) sampled MTP's policy timed the one plain stretch of a request
at 2.16 ms a step while plain decoding in the same round ran 1.12 ms a token, and drafted on
at 0.80x plain. Stretches in requests that never drafted run at plain decoding's speed
(``scripts/mtp_off_ab.py``). This alternates four drafted rounds of 3 and one plain stretch
(the policy's probe of a plain step) through each request, and reports per position in the
stretch the median time from the stretch's start (step 1) or from the previous token
(steps 2-9), and the policy's figure (the stretch's first 8 tokens over 8), beside plain
decoding's median gap between tokens, all in one process at a new prompt length each run:

- ``plain``: plain decoding;
- ``mtp-alt`` / ``two-model-alt``: the drafter alternating as above;
- ``mtp-alt-nofixed``: as ``mtp-alt`` with the verifier's fixed-shape forwards off.

    python scripts/stretch_probe.py [ROUNDS] [--temp T]   # $OUT/stretch-probe.json
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from typing import Any

from take_turns import demo_probe

from foretell.config import SamplingConfig
from foretell.model import fixed
from foretell.spec import verifier
from foretell.spec.warmup import ScriptedPolicy

ROWS = ("plain", "mtp-alt", "mtp-alt-nofixed", "two-model-alt")
CYCLE = [3, 3, 3, 3, 0]


@contextlib.contextmanager
def recorded_runs(runs: list[tuple[float, list[float]]]):
    """Append ``(start, [each token's hand-out time])`` for every plain run of the verifier."""
    real = verifier._Verifier.plain_run

    def plain_run(self: Any, *args: Any) -> Any:
        times: list[float] = []
        runs.append((time.perf_counter(), times))
        for tokens in real(self, *args):
            times.append(time.perf_counter())
            yield tokens

    verifier._Verifier.plain_run = plain_run
    try:
        yield
    finally:
        verifier._Verifier.plain_run = real


def main() -> None:
    args, engine, prompt, speculators = demo_probe(5)
    found: dict[str, dict[str, list[float]]] = {row: {} for row in ROWS}
    dropped = 0
    for index in range(args.rounds + 1):  # the first round warms every shape up, untallied
        for row in ROWS if index % 2 == 0 else ROWS[::-1]:
            dropped += 1
            sampling = SamplingConfig(temp=args.temp, seed=index) if args.temp > 0 else None
            speculate: Any = False
            if row != "plain":
                speculate = speculators[row.split("-alt")[0]]
                object.__setattr__(speculate, "policy", ScriptedPolicy(6, CYCLE * 200))
            mode = fixed.forced("off") if row.endswith("nofixed") else contextlib.nullcontext()
            runs: list[tuple[float, list[float]]] = []
            stamps: list[float] = []
            traces = fixed.trace_count()
            with mode, recorded_runs(runs):
                for event in engine.generate(prompt[: len(prompt) - dropped], max_tokens=256,
                                             ignore_eos=True, sampling=sampling,
                                             speculate=speculate):
                    if event.type == "text" and event.tokens:
                        stamps.append(time.perf_counter())
            if index == 0:  # the warm-up round: what its first compiles cost
                print("warm-up", row, f"{(len(stamps) - 1) / (stamps[-1] - stamps[0]):.1f} tok/s",
                      f"longest gap {max(b - a for a, b in zip(stamps, stamps[1:])) * 1e3:.0f} ms",
                      f"fixed-shape traces {fixed.trace_count() - traces}", flush=True)
                continue
            tally = found[row]
            gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
            tally.setdefault("gap_between_text_events", []).append(statistics.median(gaps))
            tally.setdefault("tok_s", []).append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
            for start, times in runs:
                if len(times) < 8:
                    continue
                tally.setdefault("policy_step", []).append((times[7] - start) / 8)
                tally.setdefault("step_1", []).append(times[0] - start)
                for i in range(1, min(len(times), 9)):
                    tally.setdefault(f"step_{i + 1}", []).append(times[i] - times[i - 1])
        print(index, {row: round(t["tok_s"][-1], 1) for row, t in found.items() if t}, flush=True)
    report = {row: {key: statistics.median(values) * (1 if key == "tok_s" else 1e3)
                    for key, values in tally.items()} for row, tally in found.items()}
    for row, figures in report.items():
        print(row, {key: round(value, 3) for key, value in figures.items()})
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "stretch-probe.json"), "w") as out:
        json.dump({"medians_ms": report, "every": found}, out, indent=1)


if __name__ == "__main__":
    main()
