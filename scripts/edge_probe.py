"""Where a decode's slow steps fall while the spill worker writes beside it: the cache
benchmark's interleaved decode (``foretell.cache.bench.interleaved_steps``: the spill worker
writing, resting as long, again) with each write's parts timed: opening the layout, planning
the gather (``dma plan``; the DMA itself runs in each block's job), each block's job
(gather, hash, write), the whole write (blocks, manifest, fsyncs) and deleting the copy.
Prints every step slower than SLOW times the median step with the parts that overlapped it,
and the median step wholly inside each part; PASSES decodes in turn, so a step that only a
first decode pays (a kernel built for a new shape) shows apart from one a write causes.

On the H100 host (2026-12-05) the benchmark's bf16 4B row saw 11 "edge" steps (a write began
or ended in them) at 0.04x and 0.50x idle speed in two runs, where the steps a write ran
through were 0.95x / 1.00x; the paired rounds of the same runs rule out a stall of that size
at every write (docs/benchmarks.md, "H100"). Not yet run on a GPU.

    python scripts/edge_probe.py [SHAPE] [--kv-bits N] [--tokens N] [--slow X] [--passes N]
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from foretell.platform import blas

blas.preload()

import foretell  # noqa: E402
from foretell.cache import bench as cb  # noqa: E402
from foretell.cache.codecs import snapshot_entry  # noqa: E402
from foretell.tools.bench import synthetic_model  # noqa: E402


def timed_parts(layout_type: type, events: list[tuple[str, float, float]]) -> None:
    """Wrap the block store's write parts so each appends (part, start, end) to ``events``."""
    def wrap(name: str, part: str) -> None:
        original = getattr(layout_type, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((part, start, time.perf_counter()))
        setattr(layout_type, name, timed)

    for name, part in (("__init__", "open"), ("_gather_by_dma", "dma plan"),
                       ("_store_block", "block"), ("write", "write")):
        if hasattr(layout_type, name):
            wrap(name, part)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", nargs="?", default="4b")
    parser.add_argument("--kv-bits", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--slow", type=float, default=3.0)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()

    model = synthetic_model(args.shape, "bfloat16")
    engine = foretell.load(model, kv_bits=args.kv_bits)
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(4096)]
    cb._generate(engine, prompt[:64], 4)
    cb._generate(engine, prompt)
    scratch = Path(tempfile.mkdtemp(prefix="foretell-edge-probe-"))
    try:
        tier, factory = cb._open_tier(engine, scratch / "tier", "blocks")
        engine.cache = tier
        cb._generate(engine, prompt)
        tier.flush(600)
        cb._generate(engine, prompt)
        tier.flush(600)
        engine.cache = None
        donor = max(tier.ram.entries(), key=lambda e: len(e.tokens))
        entry = tier.for_writer(snapshot_entry(donor.tokens, donor.caches, tier.codecs))
        events: list[tuple[str, float, float]] = []
        timed_parts(type(tier.ssd.layout), events)
        short = list(donor.tokens[:32])
        passes, writes = [], 0
        for _ in range(args.passes):
            steps, spans = cb.interleaved_steps(engine, factory, entry, short, scratch,
                                                args.tokens)
            events.extend(("delete", a, b) for a, b in spans["removing"])
            passes.append([(a, b) for a, b, _n in steps])
            writes += len(spans["writing"])
        tier.close(60)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"{args.shape} kv_bits={args.kv_bits}: entry {entry.tensor_bytes / 1e6:.0f} MB, "
          f"{writes} writes in {args.passes} decodes of {args.tokens} tokens")
    for number, steps in enumerate(passes, 1):
        report(number, steps, events, args.slow)


def report(number: int, steps: list[tuple[float, float]],
           events: list[tuple[str, float, float]], slow: float) -> None:
    durations = [b - a for a, b in steps]
    median = statistics.median(durations)
    t0, t1 = steps[0][0], steps[-1][1]
    print(f"decode {number}: {len(steps)} steps, median {median * 1e3:.2f} ms")
    for part in ("open", "dma plan", "block", "write", "delete"):
        spans = [(a, b) for p, a, b in events if p == part and t0 <= a <= t1]
        inside = [b - a for a, b in steps if any(s <= a and b <= e for s, e in spans)]
        took_ms = [(e - s) * 1e3 for s, e in spans]
        print(f"  {part:9s} x{len(spans):3d}: median "
              f"{statistics.median(took_ms) if took_ms else 0:8.1f} ms each; steps wholly "
              f"inside {len(inside):4d}, median "
              f"{statistics.median(inside) * 1e3 if inside else float('nan'):.2f} ms")
    print(f"  slow steps (> {slow}x median; [ a part began in it, ] one ended):")
    for index, ((a, b), d) in enumerate(zip(steps, durations)):
        if d > slow * median:
            near = sorted({f"{p}{'[' if a <= s <= b else ''}{']' if a <= e <= b else ''}"
                           for p, s, e in events if s < b and a < e})
            print(f"    step {index:4d} t={(a - t0) * 1e3:8.1f} ms "
                  f"{d * 1e3:8.1f} ms  {' '.join(near) or '-'}")


if __name__ == "__main__":
    main()
