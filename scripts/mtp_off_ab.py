"""What a speculator costs while drafting is off: plain decoding against the MTP speculator
with its draft length pinned to 0, once as the verifier runs it (the newest CATCH_UP_MAX
plain steps' hidden states kept for the head, all a head that fell behind starts over from)
and once keeping none, and against the two-model speculator pinned to 0 (no hidden states at
all). Before 2026-12-03 the verifier kept every step's state; this script measured that at
0.988x plain against 1.002x for the newest 32 (docs/speculation.md).

    python scripts/mtp_off_ab.py [ROUNDS] [--temp T] [--same-prompt] [--warm]
                                 # writes $OUT/mtp-off-ab.json (default /tmp)

Rows take turns (order flipping per round) on the demo's 992-token code prompt, each run at a
new length (``--same-prompt``: the same prompt every run, as ``round_probe`` does), 256
tokens at temperature 0.8 (``--temp``); ``--warm`` makes the speculators as ``foretell run``
does (``Engine.use_draft``, with its warm-up where the device compiles per shape). The
paired median is the median of each round's ratio to that round's plain run. Not a test:
numbers only (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse

from take_turns import decode_tps, take_turns

import foretell
from foretell.config import SamplingConfig
from foretell.spec import make_speculator, verifier
from foretell.spec.bench import code_prompts

ROWS = ("plain", "off-newest", "off-none", "two-model-off")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=15)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--same-prompt", action="store_true")
    ap.add_argument("--warm", action="store_true")
    args = ap.parse_args()
    rounds = args.rounds
    engine = foretell.load("demo")
    prompt = code_prompts(engine.tokenizer, 992)["code"]

    def pinned(kind: str):
        # Without --warm no warm-up (use_draft's): drafting never runs, so its kernels are
        # never needed.
        if args.warm:
            made = engine.use_draft(kind)
            engine.use_draft(None)
        else:
            made = make_speculator(engine.registry, engine.target, kind)
        made.policy.choose = lambda limit: 0
        return made

    speculator, two_model = pinned("mtp"), pinned("two-model")
    extend, keep = verifier._Verifier._extend, {"row": "off-newest"}

    def extending(self, kept, hidden):
        extend(self, kept, None if keep["row"] == "off-none" else hidden)

    verifier._Verifier._extend = extending
    dropped = [0]
    rows = {"plain": False, "off-newest": speculator, "off-none": speculator,
            "two-model-off": two_model}

    def sampling(seed: int) -> SamplingConfig | None:
        return SamplingConfig(temp=args.temp, seed=seed) if args.temp > 0 else None

    def run(row: str, seed: int) -> float:
        keep["row"] = row
        if not args.same_prompt:
            dropped[0] += 1  # a new prompt length every run
        return decode_tps(engine.generate(prompt[: len(prompt) - dropped[0]], max_tokens=256,
                                          ignore_eos=True, sampling=sampling(seed),
                                          speculate=rows[row]))

    take_turns(ROWS, run, rounds, "plain", "mtp-off-ab.json")

if __name__ == "__main__":
    main()
