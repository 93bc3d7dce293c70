"""CPU prefill and decode with attention's two CPU paths taking turns in one process:
``python benchmarks/cpu_attention_ab.py [LENGTHS...]`` (default 512 2048 4096).

``fused``: MLX's scaled_dot_product_attention (on the CPU its fallback: matmuls around
MLX's softmax); ``matmul-float32``: the CPU's default, matmuls around numpy's softmax for
large scores (foretell.model.attention.softmax_rows). Rerun it after an MLX upgrade: where
``fused`` catches up, the default can go back to it. Each round runs
both, in alternating order, on the shipped demo model: a cold prefill of random token ids
(TTFT) and 32 plainly decoded tokens after it. Prints medians and paired ratios; numbers
only (docs/blas.md, "Softmax").
"""

from __future__ import annotations

import os
import random
import statistics
import sys

from foretell.platform import blas

blas.preload()  # before mlx is imported (docs/blas.md)

import foretell  # noqa: E402
from foretell.model import attention  # noqa: E402

MODES = ("fused", "matmul-float32")


def main() -> None:
    lengths = [int(a) for a in sys.argv[1:]] or [512, 2048, 4096]
    engine = foretell.load("demo")
    rng = random.Random(0)
    list(engine.generate([5, 6, 7], max_tokens=2, speculate=False))
    for length in lengths:
        prompt = [rng.randrange(10, 12000) for _ in range(length)]
        seen: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "tps": []} for m in MODES}
        tokens: dict[str, list[int]] = {}
        for turn in range(3):
            for mode in MODES if turn % 2 == 0 else MODES[::-1]:
                os.environ["FORETELL_ATTENTION"] = mode
                attention._MATMUL_MODE = None  # read the variable again
                events = list(engine.generate(prompt, max_tokens=32, ignore_eos=True,
                                              speculate=False))
                stats = events[-1]
                seen[mode]["ttft"].append(stats.ttft_s)
                seen[mode]["tps"].append(stats.generation_tps)
                tokens[mode] = [t for e in events[:-1] for t in e.tokens]
        fused, ours = seen["fused"], seen["matmul-float32"]
        prefill = statistics.median(f / o for f, o in zip(fused["ttft"], ours["ttft"]))
        decode = statistics.median(o / f for f, o in zip(fused["tps"], ours["tps"]))
        print(f"{length} tokens: prefill {statistics.median(fused['ttft']):.2f} s fused, "
              f"{statistics.median(ours['ttft']):.2f} s matmul-float32 ({prefill:.2f}x "
              f"faster, paired); decode {statistics.median(fused['tps']):.1f} / "
              f"{statistics.median(ours['tps']):.1f} tok/s ({decode:.2f}x); same tokens: "
              f"{tokens['fused'] == tokens['matmul-float32']}", flush=True)


if __name__ == "__main__":
    main()
