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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from foretell.plugin.registry import Registry

EOS = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS)
TOKENIZER_VOCAB = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Gemma-style post-block norms get this gain (see :func:`_random_weights`).
POST_NORM_GAIN = 8.0


@attrs.frozen(kw_only=True)
class SyntheticSpec:
    """How to make tiny random-weight checkpoints of one architecture.

    An architecture plugin registers one with ``register(model_type, factory,
    synthetic="module:SPEC")``; tests and ``foretell bench --synthetic`` then get models of
    that architecture without core naming it.
    """

    #: A real-looking, tiny ``config.json`` (its ``model_type`` is the registered one).
    config: Mapping[str, Any]
    #: Named shapes laid over ``config`` (``foretell bench --synthetic NAME``).
    presets: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    #: The checkpoint stores RMSNorm weights as ``gain - norm_offset`` (Gemma 3 keeps
    #: offsets from one: its norm multiplies by ``1 + w``).
    norm_offset: float = 0.0
    #: ``finalize(config, overrides) -> config``: fields derived after the overrides, e.g.
    #: one layer type per layer when the layer count changed.
    finalize: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None


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


def _registry(registry: Registry | None) -> Registry:
    if registry is not None:
        return registry
    from foretell.plugin.loader import load_plugins

    return load_plugins().registry


def spec_for(model_type: str, registry: Registry | None = None) -> SyntheticSpec:
    """The synthetic spec the architecture plugin for ``model_type`` registered."""
    from foretell.plugin.registry import Kind

    registry = _registry(registry)
    spec = registry.get(Kind.ARCHITECTURE, model_type).load_synthetic()
    if spec is None:
        raise ValueError(
            f"no synthetic config for '{model_type}': its plugin registers none "
            f"(known: {', '.join(model_types(registry))})"
        )
    return spec


def model_types(registry: Registry | None = None) -> list[str]:
    """Every installed architecture that registered a synthetic spec."""
    from foretell.plugin.registry import Kind

    return sorted(
        item.name for item in _registry(registry)
        if item.kind is Kind.ARCHITECTURE and item.synthetic is not None
    )


def presets(registry: Registry | None = None) -> dict[str, str]:
    """Every named shape, ``{name: model_type}`` (the first architecture to name it wins)."""
    registry = _registry(registry)
    found: dict[str, str] = {}
    for model_type in model_types(registry):
        for name in spec_for(model_type, registry).presets:
            found.setdefault(name, model_type)
    return found


def model_config(
    model_type: str,
    overrides: dict[str, Any] | None = None,
    *,
    preset: str | None = None,
    registry: Registry | None = None,
) -> dict[str, Any]:
    """A real-looking ``config.json`` dict: the tiny base, a named shape, then overrides."""
    spec = spec_for(model_type, registry)
    config = copy.deepcopy(dict(spec.config))
    if preset is not None:
        if preset not in spec.presets:
            known = ", ".join(spec.presets) or "none"
            raise ValueError(f"unknown preset '{preset}' for {model_type} (known: {known})")
        config.update(copy.deepcopy(dict(spec.presets[preset])))
    config.update(overrides or {})
    if spec.finalize is not None:
        config = spec.finalize(config, dict(overrides or {}))
    eos = token_id(EOS)
    config.setdefault("eos_token_id", eos)
    config.setdefault("bos_token_id", token_id("<|endoftext|>"))
    return config


def _random_weights(
    model: nn.Module, spec: SyntheticSpec, config: dict[str, Any], seed: int, dtype: mx.Dtype
) -> dict[str, mx.array]:
    """Draw every parameter of ``model``; scales keep activations and logits lively."""
    hidden = config["hidden_size"]
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
            value = gain * (1.0 + noise * 0.1) - spec.norm_offset
        elif leaf == "layer_scalar":
            value = mx.ones(param.shape)
        elif param.ndim == 0:
            # A scalar is a setting the module initialised (a quantization scale, an
            # activation's epsilon), not a weight to draw: noise could flip its sign.
            value = param
        elif param.dtype == mx.uint32:
            # Packed quantized weights an architecture stores as such: random bits.
            weights[name] = mx.random.randint(-(2**31), 2**31 - 1, param.shape,
                                              key=key).view(mx.uint32)
            continue
        elif leaf == "signs":
            value = mx.where(noise < 0, -1.0, 1.0)
        elif leaf == "bias":
            value = noise * 0.1
        elif name.endswith("embed_tokens.weight") or name.startswith("lm_head."):
            # Logits are about hidden * std^2 * |h|: this puts their spread near 3.
            value = noise * (3.0 / math.sqrt(hidden))
        else:
            value = noise / math.sqrt(param.shape[-1])
        weights[name] = value.astype(dtype)
    return weights


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
    registry: Registry | None = None,
) -> Path:
    """Write a complete random-weight model directory and return its path.

    :param model_type: an installed architecture with a synthetic spec (:func:`model_types`).
    :param overrides: config.json fields to change (sizes, windows, ...).
    :param quantize_bits: 4 or 8 to store MLX affine-quantized layers, as
        ``mlx_lm.convert -q`` does (every layer whose input width ``group_size`` divides).
    :param preset: a named shape of that architecture (:attr:`SyntheticSpec.presets`).
    :param quantize_layers: per-layer overrides written into ``quantization`` (module path
        -> ``{"group_size", "bits"}`` or ``False`` to keep that layer dense).
    :param shard_bytes: split the weights into shards of about this size, with an index.
    :param registry: where the architecture is found (default: the installed plugins).
    """
    from foretell.plugin.registry import Kind

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    registry = _registry(registry)
    spec = spec_for(model_type, registry)
    config = model_config(model_type, overrides, preset=preset, registry=registry)
    config["torch_dtype"] = dtype
    model = registry.get(Kind.ARCHITECTURE, model_type).load()(config)
    weights = _random_weights(model, spec, config, seed, getattr(mx, dtype))
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
    """A model directory of a named shape (e.g. "30m"), of
    whichever installed architecture names it; ``"model_type:name"`` picks one."""
    model_type, _, name = preset.rpartition(":")
    if not model_type:
        shapes = presets(kwargs.get("registry"))
        if preset not in shapes:
            raise ValueError(f"unknown preset '{preset}' (known: {', '.join(shapes) or 'none'})")
        model_type = shapes[preset]
    return make_model_dir(path, model_type, preset=name, seed=seed, dtype=dtype, **kwargs)
