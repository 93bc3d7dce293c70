"""Measure what shapes the verifier's attention on this machine (not a test).

    python benchmarks/attention_probe.py [--model demo] [--reps 60] [--json FILE]
    python benchmarks/attention_probe.py --identity [--model demo]

1. The raw fused kernel with a 3-token query while the key length changes every call, and
   while it repeats, beside :func:`foretell.model.attention.matmul_attention` on the same
   shapes.
2. A 3-token target forward at growing offsets (a verify window), fused vs matmul.
3. Single-token decode latency over many steps (mean, p99, max: the "stalls"), fused vs
   matmul, by forcing ``FORETELL_ATTENTION`` per run.
4. A forward of 8 to 2,048 tokens after a ~1,000-token prompt, at a key length not seen
   before each time (a drafter's catch-up, a suffix after a cache hit, a prompt's last
   chunk), per attention rule.

``--identity`` instead compares each drafter's greedy output with plain decoding on this
device, and where they first differ, both forward shapes' top-2 logit gaps (a bfloat16 GPU
rounds a verify window and a plain step differently).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any


def _timed(fn, reps: int) -> list[float]:
    import mlx.core as mx

    out = []
    for i in range(reps):
        start = time.perf_counter()
        mx.eval(fn(i))
        out.append((time.perf_counter() - start) * 1000)
    return out


def _summary(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {"mean_ms": statistics.fmean(ms), "median_ms": statistics.median(ms),
            "p99_ms": ordered[int(0.99 * (len(ordered) - 1))], "max_ms": ordered[-1]}


def raw_kernel(dtype: str = "bfloat16", reps: int = 60) -> dict[str, object]:
    import mlx.core as mx

    from foretell.model.attention import matmul_attention

    dt = getattr(mx, dtype)
    q = mx.random.normal((1, 16, 3, 128)).astype(dt)
    kv = mx.random.normal((1, 8, 1200, 128)).astype(dt)
    mx.eval(q, kv)

    def fused(lk):
        return lambda i: mx.fast.scaled_dot_product_attention(
            q, kv[:, :, : lk(i)], kv[:, :, : lk(i)], scale=0.088, mask="causal")

    def matmul(lk):
        return lambda i: matmul_attention(q, kv[:, :, : lk(i)], kv[:, :, : lk(i)], scale=0.088,
                                          mask="causal")

    growing, fixed = (lambda i: 1000 + i), (lambda i: 1000)
    return {
        "fused_changing_lk": _summary(_timed(fused(growing), reps)),
        "fused_fixed_lk": _summary(_timed(fused(fixed), reps)),
        "matmul_changing_lk": _summary(_timed(matmul(growing), reps)),
    }


def _forward_probe(model_dir: str, mode: str, reps: int) -> dict[str, object]:
    import mlx.core as mx

    from foretell.engine import load
    from foretell.model import attention
    from foretell.request import prefill

    attention._MATMUL_MODE = mode
    engine = load(model_dir)
    model = engine.model
    prompt = list(range(1, 1001))
    caches = model.make_caches()
    prefill(model, prompt, caches)
    window = mx.array([[5, 6, 7]], dtype=mx.int32)

    def verify(_i):
        hidden, _ = model.forward(window, caches)
        for c in caches:  # keep one of the three: the offset grows by one per call
            c.trim(2)
        return model.logits(hidden)

    verify_ms = _timed(verify, reps)
    token = mx.array([[9]], dtype=mx.int32)

    def decode(_i):
        hidden, _ = model.forward(token, caches)
        return model.logits(hidden)

    decode_ms = _timed(decode, reps * 8)
    return {"verify3_growing_offset": _summary(verify_ms[5:]),
            "decode1": _summary(decode_ms[5:]), "new_shape_ms": _new_shapes(model)}


def _new_shapes(model: Any, repeats: int = 3) -> dict[int, list[float]]:
    """Milliseconds of a forward of ``L`` tokens after a prompt of a length not used
    before, per ``L``: what a shape the attention kernel has not seen costs."""
    import mlx.core as mx

    from foretell.request import prefill

    out: dict[int, list[float]] = {}
    for i, length in enumerate((8, 64, 512, 2048)):
        out[length] = []
        for r in range(repeats):
            caches = model.make_caches()
            prefill(model, list(range(1, 990 + 5 * (i * repeats + r))), caches)
            mx.synchronize()
            start = time.perf_counter()
            prefill(model, [7] * length, caches)
            mx.synchronize()
            out[length].append((time.perf_counter() - start) * 1000)
    return out


def _margins(engine: Any, context: list[int], window: int = 4) -> dict[str, object]:
    """The next token's logits after ``context`` two ways: a single-token step over a cache
    of ``context[:-1]`` (plain decoding's shape) and the last row of a ``window``-token
    forward (a verify window's shape). Their top-2 gaps say whether a difference there is a
    near-tie under kernel rounding or a real disagreement."""
    import mlx.core as mx

    from foretell.request import prefill

    def last_logits(split: int) -> mx.array:
        caches = engine.model.make_caches()
        prefill(engine.model, context[:split], caches)
        hidden, _ = engine.model.forward(mx.array([context[split:]], dtype=mx.int32), caches)
        return engine.model.logits(hidden)[0, -1].astype(mx.float32)

    out: dict[str, object] = {}
    rows = {"decode1": last_logits(len(context) - 1),
            f"window{window}": last_logits(len(context) - window)}
    for name, row in rows.items():
        top = mx.argsort(-row)[:2].tolist()
        out[name] = {"top2": top, "gap": float(row[top[0]] - row[top[1]])}
    a, b = rows.values()
    out["max_abs_diff"] = float(mx.max(mx.abs(a - b)))
    return out


def identity(model_dir: str, tokens: int = 256, kinds: tuple[str, ...] = ("two-model", "mtp",
             "ngram")) -> dict[str, object]:
    """Greedy output of each drafter against plain decoding on this device: the first
    difference (or None) and, there, both forward shapes' top-2 logit gaps."""
    from foretell.engine import load
    from foretell.tools.bench_spec import code_prompts

    engine = load(model_dir)
    prompts = code_prompts(engine.tokenizer, 512)
    out: dict[str, object] = {}
    plains: dict[str, list[int]] = {}
    for name, prompt in prompts.items():
        plains[name] = [t for e in engine.generate(prompt, max_tokens=tokens, ignore_eos=True,
                                                   speculate=False) if e.type == "text"
                        for t in e.tokens]
    for kind in kinds:
        try:
            speculator = engine.use_draft(kind)
        except Exception as exc:  # a drafter this model cannot use
            out[kind] = f"skipped: {exc}"
            continue
        for name, prompt in prompts.items():
            plain = plains[name]
            spec = [t for e in engine.generate(prompt, max_tokens=tokens, ignore_eos=True,
                                               speculate=speculator) if e.type == "text"
                    for t in e.tokens]
            first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
            row: dict[str, object] = {"identical": plain == spec, "first_difference": first}
            if first is not None:
                row["plain_token"], row["spec_token"] = plain[first], spec[first]
                row["at_difference"] = _margins(engine, list(prompt) + plain[:first])
            out[f"{kind}/{name}"] = row
    return out


def main(argv: list[str] | None = None) -> int:
    from foretell.platform import blas

    blas.preload()
    ap = argparse.ArgumentParser(prog="python benchmarks/attention_probe.py")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--json", default=None)
    ap.add_argument("--identity", action="store_true",
                    help="instead: greedy output of each drafter vs plain decoding")
    args = ap.parse_args(argv)
    import mlx.core as mx

    if args.identity:
        print(json.dumps(identity(args.model), indent=2))
        return 0

    report: dict[str, object] = {"device": str(mx.default_device()), "mlx": mx.__version__,
                                 "raw_kernel": raw_kernel(reps=args.reps)}
    for mode in ("fused", "matmul", "matmul-all"):
        report[f"forward_{mode}"] = _forward_probe(args.model, mode, args.reps)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
