"""Which CPU path computes a quantized checkpoint closer to the model itself: foretell's
default (quantized layers unpacked to float32, the model run in float32) or mlx-lm's
(packed layers, computed in the scales' dtype)?

"The model itself" is the checkpoint evaluated exactly: every weight dequantized
(``scales * q + biases``, exact in float64) and the Qwen3 forward run in float64 with
numpy. For random Qwen3 checkpoints quantized to 4 and 8 bits with bfloat16 and float16
scales (and, with ``--demo``, the shipped demo model), it prints each path's prompt-logit
error against that reference and how many greedy tokens each agrees with the float64
model's greedy continuation. foretell packed (``FORETELL_CPU_UNPACK=0``) is mlx-lm bit for
bit; it is printed as a check.

    python benchmarks/quantized_fidelity.py                # about a minute of CPU
    python benchmarks/quantized_fidelity.py --seeds 3 --demo --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = {
    # the synthetic base shape, and a wider one with more layers
    "tiny": {},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32},
}


# -- the float64 reference ---------------------------------------------------------------


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """MLX's affine packing: each uint32 holds 32 / bits values, lowest bits first."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint64) * bits
    values = (packed.astype(np.uint64)[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)


def float64_weights(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float64, quantized layers dequantized exactly."""
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    quant = config.get("quantization") or {}
    raw = {}
    for file in sorted(model_dir.glob("model*.safetensors")):
        raw.update(mx.load(str(file)))
    out = {}
    for name, tensor in raw.items():
        if name.endswith((".scales", ".biases")):
            continue
        if tensor.dtype == mx.uint32:
            stem = name.removesuffix(".weight")
            scales = np.array(raw[f"{stem}.scales"].astype(mx.float32), dtype=np.float64)
            biases = np.array(raw[f"{stem}.biases"].astype(mx.float32), dtype=np.float64)
            layer = quant.get(stem)
            bits = layer["bits"] if isinstance(layer, dict) else quant["bits"]
            group = tensor.shape[-1] * 32 // bits // scales.shape[-1]
            q = unpack(np.array(tensor), bits).astype(np.float64)
            q = q.reshape(*q.shape[:-1], -1, group)
            out[name] = (q * scales[..., None] + biases[..., None]).reshape(*q.shape[:-2], -1)
        else:
            out[name] = np.array(tensor.astype(mx.float32), dtype=np.float64)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, base: float) -> np.ndarray:
    """Non-traditional RoPE (halves rotated), positions from 0: mlx's nn.RoPE."""
    length, dims = x.shape[-2], x.shape[-1]
    half = dims // 2
    freqs = base ** (-np.arange(half, dtype=np.float64) * 2 / dims)
    angles = np.arange(length, dtype=np.float64)[:, None] * freqs[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def qwen3_logits(w: dict[str, np.ndarray], config: dict, tokens: list[int]) -> np.ndarray:
    """mlx-lm's Qwen3 forward (tied head), in float64: logits for every position."""
    eps, base = config["rms_norm_eps"], config["rope_theta"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    h = w["model.embed_tokens.weight"][tokens]
    length = len(tokens)
    mask = np.triu(np.full((length, length), -np.inf), 1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
        q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(length, heads, head_dim)
        k = (x @ w[p + "self_attn.k_proj.weight"].T).reshape(length, kv_heads, head_dim)
        v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(length, kv_heads, head_dim)
        q = rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], eps).transpose(1, 0, 2), base)
        k = rope(rms_norm(k, w[p + "self_attn.k_norm.weight"], eps).transpose(1, 0, 2), base)
        v = v.transpose(1, 0, 2)
        k = np.repeat(k, heads // kv_heads, axis=0)
        v = np.repeat(v, heads // kv_heads, axis=0)
        scores = q @ k.transpose(0, 2, 1) * head_dim**-0.5 + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = (scores / scores.sum(axis=-1, keepdims=True)) @ v
        h = h + attn.transpose(1, 0, 2).reshape(length, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = rms_norm(h, w[p + "post_attention_layernorm.weight"], eps)
        gate = x @ w[p + "mlp.gate_proj.weight"].T
        up = x @ w[p + "mlp.up_proj.weight"].T
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    h = rms_norm(h, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return h @ head.T


def greedy_float64(w, config, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(qwen3_logits(w, config, tokens)[-1])))
    return tokens[len(prompt):]


# -- the two MLX paths ----------------------------------------------------------------------


def mlx_paths(model_dir: Path, registry):
    """foretell unpacked (the CPU default), foretell packed, and mlx-lm, as logit functions
    of a token list plus a greedy continuation each."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_lm_load_model

    from foretell.model import load_model

    def foretell_side(unpack_setting: str):
        previous = os.environ.get("FORETELL_CPU_UNPACK")
        os.environ["FORETELL_CPU_UNPACK"] = unpack_setting
        try:
            model = load_model(model_dir, registry)
        finally:
            os.environ.pop("FORETELL_CPU_UNPACK")
            if previous is not None:
                os.environ["FORETELL_CPU_UNPACK"] = previous

        def logits(tokens):
            return model.logits(model.forward(mx.array([tokens]))[0])[0]

        def greedy(prompt, n):
            caches = model.make_caches()
            hidden, _ = model.forward(mx.array([prompt]), caches)
            out = [int(mx.argmax(model.logits(hidden[:, -1]), axis=-1).item())]
            while len(out) < n:
                hidden, _ = model.forward(mx.array([[out[-1]]]), caches)
                out.append(int(mx.argmax(model.logits(hidden[:, -1]), axis=-1).item()))
            return out

        return logits, greedy

    reference, _ = mlx_lm_load_model(model_dir)

    def mlx_lm_logits(tokens):
        return reference(mx.array([tokens]))[0]

    def mlx_lm_greedy(prompt, n):
        cache = make_prompt_cache(reference)
        out = [int(mx.argmax(reference(mx.array([prompt]), cache=cache)[:, -1], axis=-1).item())]
        while len(out) < n:
            logits = reference(mx.array([[out[-1]]]), cache=cache)
            out.append(int(mx.argmax(logits[:, -1], axis=-1).item()))
        return out

    return {
        "foretell (unpacked float32, default)": foretell_side("1"),
        "foretell packed": foretell_side("0"),
        "mlx-lm": (mlx_lm_logits, mlx_lm_greedy),
    }


def agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens two continuations share."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def measure(model_dir: Path, prompt: list[int], generate: int, registry) -> dict:
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    w64 = float64_weights(model_dir)
    exact = qwen3_logits(w64, config, prompt)
    exact_greedy = greedy_float64(w64, config, prompt, generate)
    row = {}
    for name, (logits, greedy) in mlx_paths(model_dir, registry).items():
        got = np.array(logits(prompt).astype(mx.float32), dtype=np.float64)
        diff = got - exact
        row[name] = {
            "max_rel": float(np.abs(diff).max() / np.abs(exact).max()),
            "rms_rel": float(np.sqrt((diff**2).mean() / (exact**2).mean())),
            "argmax_agree": float((got.argmax(-1) == exact.argmax(-1)).mean()),
            "greedy_agree": agreeing(greedy(prompt, generate), exact_greedy),
        }
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="random checkpoints per case")
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--generate", type=int, default=24, help="greedy tokens compared")
    parser.add_argument("--demo", action="store_true", help="also the shipped demo model")
    parser.add_argument("--json", default=None, metavar="FILE")
    args = parser.parse_args()

    from foretell.platform import blas

    blas.preload()
    import mlx.core as mx

    from foretell.plugin import load_plugins
    from foretell.tools import make_model_dir

    mx.set_default_device(mx.cpu)
    registry = load_plugins().registry
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(shape, bits, dtype, seed) for shape in SHAPES for bits in (4, 8)
                 for dtype in ("bfloat16", "float16") for seed in range(args.seeds)]
        for shape, bits, dtype, seed in cases:
            path = make_model_dir(Path(tmp) / f"{shape}-{bits}-{dtype}-{seed}", "qwen3",
                                  overrides=SHAPES[shape], quantize_bits=bits, dtype=dtype,
                                  seed=seed)
            rng = np.random.default_rng(seed)
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            prompt = [int(t) for t in rng.integers(1, vocab, args.prompt_tokens)]
            row = measure(path, prompt, args.generate, registry)
            results.append({"case": f"{shape} {bits}-bit {dtype} seed {seed}", **row})
            print_row(results[-1])
        if args.demo:
            from foretell.engine import resolve_model_path
            from foretell.tokenizer import Tokenizer

            demo = resolve_model_path("demo")
            prompt = Tokenizer.from_dir(demo).encode("def fibonacci(n):")
            results.append({"case": "demo (4-bit, bfloat16 scales)",
                            **measure(demo, prompt, args.generate, registry)})
            print_row(results[-1])
    summarize(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_row(row: dict) -> None:
    print(row["case"])
    for name, m in row.items():
        if name == "case":
            continue
        print(f"  {name:38s} max rel {m['max_rel']:.2e}  rms rel {m['rms_rel']:.2e}  "
              f"argmax {m['argmax_agree']:.0%}  greedy agrees {m['greedy_agree']}")
    sys.stdout.flush()


def summarize(results: list[dict]) -> None:
    ours, theirs = "foretell (unpacked float32, default)", "mlx-lm"
    closer = sum(r[ours]["rms_rel"] < r[theirs]["rms_rel"] for r in results)
    ratio = [r[theirs]["rms_rel"] / r[ours]["rms_rel"] for r in results]
    print(f"\nforetell's default is closer to the float64 model in {closer} of {len(results)} "
          f"checkpoints (rms error ratio mlx-lm / foretell: median {np.median(ratio):.0f}x, "
          f"min {min(ratio):.1f}x)")
    same = all(r["foretell packed"]["max_rel"] == r[theirs]["max_rel"] for r in results)
    print(f"foretell packed == mlx-lm on every checkpoint: {same}")


if __name__ == "__main__":
    raise SystemExit(main())
