"""Random-weight model directories of real architectures, for tests and benchmarks.

No machine here reaches a model hub, so tests compare foretell against mlx-lm on
synthetic checkpoints: a real-looking ``config.json``, random ``model.safetensors``
(quantized the way ``mlx_lm.convert -q`` writes them when asked), a small byte-level
BPE ``tokenizer.json`` trained offline, ``tokenizer_config.json`` with a ChatML template,
and ``generation_config.json``.

Weights are drawn for exactly the parameters foretell's own architecture declares, so
names and shapes are the checkpoint's by construction; the oracle tests load the same
files with mlx-lm (strict), which catches any drift from the real layout.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

EOS = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS)
TOKENIZER_VOCAB = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_BASE: dict[str, dict[str, Any]] = {
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "sliding_window": 32768,
        "use_sliding_window": False,
        "torch_dtype": "float32",
    },
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "vocab_size": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "max_position_embeddings": 32768,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    "gemma4_text": {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_kv_shared_layers": 2,
        "hidden_size_per_layer_input": 16,
        "vocab_size": TOKENIZER_VOCAB,
        "vocab_size_per_layer_input": TOKENIZER_VOCAB,
        "rms_norm_eps": 1e-6,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True,
        "attention_k_eq_v": False,
        "enable_moe_block": False,
        "max_position_embeddings": 131072,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
}

#: Named Qwen3 shapes. 30m/150m are the shapes of the project's CPU anchor figures; 0.6b
#: and 4b are the real Qwen3-0.6B / Qwen3-4B shapes (random weights).
QWEN3_PRESETS: dict[str, dict[str, Any]] = {
    "30m": {
        "hidden_size": 512,
        "num_hidden_layers": 4,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    "150m": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "intermediate_size": 3584,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 32000,
    },
    "0.6b": {
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "intermediate_size": 3072,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
    "4b": {
        "hidden_size": 2560,
        "num_hidden_layers": 36,
        "intermediate_size": 9728,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
    },
}

MODEL_TYPES = tuple(_BASE)

# Gemma 3 stores RMSNorm weights as offsets from one (the norm multiplies by 1 + w).
_OFFSET_NORMS = frozenset({"gemma3_text"})
POST_NORM_GAIN = 8.0

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads tokens one at a time and
predicts what comes next; speculative decoding lets a small drafter guess several tokens
that the large target then verifies in one forward pass. Greedy speculation must emit
exactly the tokens plain greedy decoding would emit, so the target decides every token.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
class Cache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items = {}
    def get(self, key, default=None):
        return self.items.get(key, default)
Persistence is atomic: write a temporary file, fsync it, then rename it into place.
Every tensor is checksummed, and a file from another model is never served.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 65536 3.14159 2.71828.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Write a haiku about caches. Assistant: Keys fill the window, old tokens slide out
of view, the ring turns again.
"""


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer trained on the in-code corpus (built once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer.to_str()


def token_id(token: str) -> int:
    """The id the synthetic tokenizer gives a special token."""
    vocab = json.loads(tokenizer_json())["added_tokens"]
    return next(t["id"] for t in vocab if t["content"] == token)


def model_config(
    model_type: str, overrides: dict[str, Any] | None = None, *, preset: str | None = None
) -> dict[str, Any]:
    """A real-looking ``config.json`` dict: the tiny base, a named shape, then overrides."""
    if model_type not in _BASE:
        raise ValueError(f"no synthetic config for '{model_type}' (known: {', '.join(_BASE)})")
    config = copy.deepcopy(_BASE[model_type])
    if preset is not None:
        if model_type != "qwen3" or preset not in QWEN3_PRESETS:
            raise ValueError(
                f"unknown preset '{preset}' for {model_type} (qwen3: {', '.join(QWEN3_PRESETS)})"
            )
        config.update(QWEN3_PRESETS[preset])
    config.update(overrides or {})
    if model_type == "gemma4_text" and "layer_types" not in (overrides or {}):
        pattern = _BASE["gemma4_text"]["layer_types"][:3]
        layers = config["num_hidden_layers"]
        config["layer_types"] = (pattern * (layers // 3 + 1))[:layers]
    eos = token_id(EOS)
    config.setdefault("eos_token_id", eos)
    config.setdefault("bos_token_id", token_id("<|endoftext|>"))
    return config


def _random_weights(
    model: nn.Module, model_type: str, config: dict[str, Any], seed: int, dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Draw every parameter of ``model``; scales keep activations and logits lively."""
    hidden = config["hidden_size"]
    offset_norms = model_type in _OFFSET_NORMS
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for (name, param), key in zip(params, keys):
        noise = mx.random.normal(param.shape, key=key)
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            # Gemma scales its (tied) input embedding by sqrt(hidden); with unit block
            # outputs the residual stays so close to it that greedy decoding repeats the
            # input token forever. Louder post-block norms keep continuations varied.
            gain = POST_NORM_GAIN if ".post_" in name else 1.0
            value = gain * (1.0 + noise * 0.1) - (1.0 if offset_norms else 0.0)
        elif leaf == "layer_scalar":
            value = mx.ones(param.shape)
        elif leaf == "bias":
            value = noise * 0.1
        elif name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            # Logits are about hidden * std^2 * |h|: this puts their spread near 3.
            value = noise * (3.0 / math.sqrt(hidden))
        else:
            value = noise / math.sqrt(param.shape[-1])
        weights[name] = value.astype(dtype)
    return weights


def _architecture(model_type: str) -> Any:
    from foretell.plugins import load_plugins
    from foretell.registry import Kind

    return load_plugins().registry.get(Kind.ARCHITECTURE, model_type).load()


def make_model_dir(
    path: str | Path,
    model_type: str,
    *,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    quantize_bits: int | None = None,
    dtype: str = "float32",
    preset: str | None = None,
    quantize_layers: dict[str, Any] | None = None,
    group_size: int = 64,
    shard_bytes: int | None = None,
) -> Path:
    """Write a complete random-weight model directory and return its path.

    :param model_type: one of :data:`MODEL_TYPES`.
    :param overrides: config.json fields to change (sizes, windows, ...).
    :param quantize_bits: 4 or 8 to store MLX affine-quantized layers, as
        ``mlx_lm.convert -q`` does (every layer whose input width ``group_size`` divides).
    :param preset: a named Qwen3 shape from :data:`QWEN3_PRESETS`.
    :param quantize_layers: per-layer overrides written into ``quantization`` (module path
        -> ``{"group_size", "bits"}`` or ``False`` to keep that layer dense).
    :param shard_bytes: split the weights into shards of about this size, with an index.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model_config(model_type, overrides, preset=preset)
    config["torch_dtype"] = dtype
    model = _architecture(model_type)(config)
    weights = _random_weights(model, model_type, config, seed, getattr(mx, dtype))
    if config.get("tie_word_embeddings"):
        # A tied checkpoint has no head; sanitize lets models that infer tying from the
        # checkpoint (Gemma 3) drop theirs before quantizing.
        weights = {n: w for n, w in weights.items() if not n.startswith("lm_head.")}
    weights = model.sanitize(weights)
    if quantize_bits is not None:
        weights, config = _quantize(
            model, weights, config, quantize_bits, group_size, quantize_layers
        )
    _write_weights(path, weights, shard_bytes)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    _write_tokenizer_files(path, config)
    return path


def _quantize(
    model: nn.Module,
    weights: dict[str, mx.array],
    config: dict[str, Any],
    bits: int,
    group_size: int,
    per_layer: dict[str, Any] | None,
) -> tuple[dict[str, mx.array], dict[str, Any]]:
    if bits not in (4, 8):
        raise ValueError(f"quantize_bits must be 4 or 8, got {bits}")
    per_layer = dict(per_layer or {})
    model.update(tree_unflatten(list(weights.items())))

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        return per_layer.get(path, True)

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    quantization = {"group_size": group_size, "bits": bits, "mode": "affine", **per_layer}
    config = {**config, "quantization": quantization, "quantization_config": quantization}
    return dict(tree_flatten(model.parameters())), config


def _write_weights(path: Path, weights: dict[str, mx.array], shard_bytes: int | None) -> None:
    names = sorted(weights)
    if shard_bytes is None:
        mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if shards[-1] and size + weights[name].nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += weights[name].nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(
            str(path / file), {n: weights[n] for n in shard}, metadata={"format": "mlx"}
        )
        weight_map.update({n: file for n in shard})
    index = {
        "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
        "weight_map": weight_map,
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer_files(path: Path, config: dict[str, Any]) -> None:
    (path / "tokenizer.json").write_text(tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": config.get("max_position_embeddings", 32768),
        "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))


def make_preset_dir(
    path: str | Path, preset: str, *, seed: int = 0, dtype: str = "float32", **kwargs: Any
) -> Path:
    """A Qwen3 model directory of a named shape ("30m", "150m", "0.6b", "4b")."""
    return make_model_dir(path, "qwen3", preset=preset, seed=seed, dtype=dtype, **kwargs)
