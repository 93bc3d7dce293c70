"""Requests that each draft past a KV capacity the process has not yet traced: their longest
wait, the fixed-shape traces meanwhile and the kernels compiled (H200 question, not a test).

On the H200 (2026-12-03 13:34) a sampled MTP request that first drafted past 1,024 tokens in
its process waited 29.6 s once, with 12 traces, where fixed shapes off waited at most 9 ms.
Answered at 15:43 by this script, run twice on a fresh host: the wait (36.6 s) came with the
first MLX-CUDA work of the host's first process, whatever request that was; traces of new
capacities compiled nothing, and the second process waited at most 88 ms. The wait is
MLX compiling kernels with NVRTC, two quantized matmuls of ~33 s each among them (its
"kernels compiled" counts files, three per kernel; the driver's cache, read then as the
cause, costs 0.4 s: docs/benchmarks.md, "A fresh CUDA host's first run").
This process first warms up on a short prompt (greedy and sampled, drafting, no capacity
past 1,024), then runs, each crossing a new capacity step of ``foretell.model.fixed``:

1. greedy, a 990-token prompt (crosses 1,024);
2. sampled at 0.8, 1,990 tokens (crosses 2,048);
3. sampled at 0.8, 2,990 tokens, fixed shapes off (crosses 3,072: the control).

So a wait in (1) and (2) and not (3) is the traces' (greedy and sampled alike); in (2) only,
something of sampled rounds. MTP drafts 3 a round, with a plain stretch after every four.

    python scripts/first_cross.py
"""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
import time

from stretch_probe import CYCLE

import foretell
from foretell.config import SamplingConfig
from foretell.model import fixed
from foretell.spec import make_speculator
from foretell.spec.bench import code_prompts
from foretell.spec.warmup import ScriptedPolicy

REQUESTS = ((0.0, 990, "on"), (0.8, 1990, "on"), (0.8, 2990, "off"))


def compiled_kernels() -> tuple[int, int]:
    """Files in MLX-CUDA's kernel cache (NVRTC output, ``MLX_PTX_CACHE_DIR`` or
    ``<tmp>/mlx/<version>/ptx``) and bytes in the CUDA driver's (``~/.nv/ComputeCache``):
    what grew during a request is what it compiled."""
    ptx = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx")
    driver = os.environ.get("CUDA_CACHE_PATH") or os.path.expanduser("~/.nv/ComputeCache")
    files = [f for f in glob.glob(os.path.join(ptx, "**"), recursive=True) if os.path.isfile(f)]
    return len(files), sum(os.path.getsize(f) for f in glob.glob(
        os.path.join(driver, "**"), recursive=True) if os.path.isfile(f))


def run(engine, speculate, prompt, temp: float, mode: str, tokens: int = 256) -> str:
    object.__setattr__(speculate, "policy", ScriptedPolicy(6, CYCLE * 200))
    sampling = SamplingConfig(temp=temp, seed=0) if temp > 0 else None
    stamps, traces, (ptx, driver) = [], fixed.trace_count(), compiled_kernels()
    with fixed.forced(mode) if mode == "off" else contextlib.nullcontext():
        for event in engine.generate(prompt, max_tokens=tokens, ignore_eos=True,
                                     sampling=sampling, speculate=speculate):
            if event.type == "text" and event.tokens:
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # after the first token
    at = max(range(len(gaps)), key=gaps.__getitem__)
    long = [g for g in gaps if g > 0.1]
    ptx_now, driver_now = compiled_kernels()
    return (f"temp {temp}, {len(prompt)}-token prompt, fixed shapes {mode}: "
            f"{(len(stamps) - 1) / (stamps[-1] - stamps[0]):.1f} tok/s, longest wait "
            f"{gaps[at] * 1e3:.0f} ms after text event {at + 1}, {len(long)} waits over "
            f"100 ms ({sum(long):.1f} s), traces {fixed.trace_count() - traces}, "
            f"kernels compiled {ptx_now - ptx} (driver cache +{(driver_now - driver) >> 10} KiB)")


def main() -> None:
    engine = foretell.load("demo")
    code = code_prompts(engine.tokenizer, 3000)["code"]
    speculate = make_speculator(engine.registry, engine.target, "mtp")
    for temp in (0.0, 0.8):
        print("warm-up:", run(engine, speculate, code[:200], temp, "on", 128), flush=True)
    for temp, length, mode in REQUESTS:
        print(run(engine, speculate, code[:length], temp, mode), flush=True)


if __name__ == "__main__":
    main()
