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

import contextlib

from take_turns import decode_tps, demo_probe, take_turns

from foretell.config import SamplingConfig
from foretell.model import fixed
from foretell.spec.warmup import ScriptedPolicy

ROWS = ("plain", "mtp-off", "mtp-3-off", "mtp-3-off-nofixed", "two-model-off", "two-model-3-off")


def main() -> None:
    args, engine, prompt, speculators = demo_probe(11)
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
        sampling = SamplingConfig(temp=args.temp, seed=seed) if args.temp > 0 else None
        with mode:
            return decode_tps(engine.generate(prompt[: len(prompt) - dropped[0]], max_tokens=256,
                                              ignore_eos=True, sampling=sampling,
                                              speculate=speculate))

    take_turns(ROWS, run, args.rounds, "plain", "plain-after-draft.json")

if __name__ == "__main__":
    main()
