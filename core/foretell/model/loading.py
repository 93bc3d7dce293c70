"""Open a model directory: ``config.json`` + safetensors weights -> a :class:`Model`.

The architecture comes from the registry by ``model_type``; weights are read lazily
(``mx.load`` maps the files), passed through the model's ``sanitize``, quantized layers
are rebuilt from what the checkpoint holds (MLX affine format, as ``mlx_lm.convert -q``
writes it), and every tensor's name, shape and dtype is checked against the model before
it is used. Without an index, every ``model*.safetensors`` is a shard (as in mlx-lm). Anything
wrong with the directory raises :class:`ModelLoadError` naming the file and the tensor
or field. Tokenizers are read elsewhere (:mod:`foretell.tokenizer`).
"""

from __future__ import annotations

import json
import os
import struct
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from foretell.config import engine_choice
from foretell.errors import ModelLoadError, UnknownContribution
from foretell.model.contract import Model
from foretell.plugin.registry import Kind, Registry

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_GLOB = "model*.safetensors"
#: What a dense (not packed) tensor may hold; anything else would compute garbage.
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
#: On the CPU, quantized weights up to this many float32 bytes are unpacked at load time.
CPU_UNPACK_LIMIT = 4 << 30


# -- config.json -> typed architecture args ---------------------------------------------


def require_divides(args: Any, divisor: str, dividend: str) -> None:
    """Refuse a config where ``args.<divisor>`` does not divide ``args.<dividend>`` (head
    counts, head widths), naming the field the way every other config error does."""
    if getattr(args, dividend) % getattr(args, divisor):
        raise ValueError(
            f"field '{divisor}': {getattr(args, divisor)} does not divide "
            f"{dividend}={getattr(args, dividend)}"
        )


def args_from_config(cls: type, config: dict[str, Any]) -> Any:
    """Build a frozen attrs args class from ``config``, ignoring keys it does not declare
    (HF configs carry many). Values are type-checked; errors name the field."""
    attrs.resolve_types(cls)
    values, missing = {}, []
    for field in attrs.fields(cls):
        value = config.get(field.name)
        if value is None:
            if field.default is attrs.NOTHING and not _allows_none(field.type):
                missing.append(field.name)
            elif field.name in config and _allows_none(field.type):
                values[field.name] = None
            continue
        values[field.name] = _check(field.name, value, field.type)
    if missing:
        raise ValueError(f"missing required field(s): {', '.join(missing)}")
    return cls(**values)


def _allows_none(kind: Any) -> bool:
    return kind is Any or type(None) in typing.get_args(kind)


def _check(name: str, value: Any, kind: Any) -> Any:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        problems = []
        for option in options:
            try:
                return _check(name, value, option)
            except ValueError as exc:
                problems.append(exc)
        raise problems[0]
    if kind is Any:
        return value
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        expected = origin or kind
        ok = isinstance(value, expected)
    if not ok:
        expected_name = getattr(origin or kind, "__name__", str(kind))
        raise ValueError(f"field '{name}': expected {expected_name}, got {value!r}")
    return value


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a model directory."""
    file = Path(path) / CONFIG
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{file}: not found; a model directory needs a config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot be read as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(config).__name__}")
    if not isinstance(config.get("model_type"), str):
        raise ModelLoadError(f"{file}: field 'model_type' is missing or not a string")
    return config


# -- weights -----------------------------------------------------------------------------


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, from its index when it has one."""
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index: {exc}") from exc
        files = [path / name for name in names]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{file}: listed in {index.name} but missing")
        return files
    # Without an index, every model*.safetensors is a shard, as mlx-lm reads a directory.
    files = sorted(f for f in path.glob(SHARD_GLOB) if f.is_file())
    if not files:
        raise ModelLoadError(
            f"{path / SINGLE_FILE}: not found (nor {INDEX_FILE} or other {SHARD_GLOB} files); "
            "the model directory has no weights"
        )
    return files


def check_safetensors(file: Path) -> None:
    """Reject a truncated or corrupt file before mapping it: the header must parse and
    every tensor's byte range must lie inside the file."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ValueError("shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise ValueError(f"header claims {header_len} bytes, file has {size}")
            header = json.loads(fh.read(header_len))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc
    data_len = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info.get("data_offsets", [0, 0])[1] if isinstance(info, dict) else None
        if not isinstance(end, int) or end > data_len:
            raise ModelLoadError(
                f"{file}: truncated or corrupt: tensor '{name}' ends at byte {end} of the "
                f"data section, which holds {data_len} bytes"
            )


def read_weights(path: Path) -> tuple[dict[str, mx.array], dict[str, Path]]:
    """All tensors (lazily mapped) and the file each came from."""
    weights: dict[str, mx.array] = {}
    source: dict[str, Path] = {}
    for file in weight_files(path):
        check_safetensors(file)
        try:
            tensors = mx.load(str(file))
        except Exception as exc:
            raise ModelLoadError(f"{file}: cannot be loaded: {exc}") from exc
        for name, tensor in tensors.items():
            if name in weights:
                raise ModelLoadError(f"{file}: tensor '{name}' also appears in {source[name]}")
            weights[name] = tensor
            source[name] = file
    return weights, source


def quantize_like_checkpoint(
    model: nn.Module,
    config: dict[str, Any],
    weights: dict[str, mx.array],
    source: Mapping[str, Path] | None = None,
) -> None:
    """Turn the layers the checkpoint stores quantized into quantized layers.

    ``config["quantization"]`` holds the defaults and, keyed by module path, per-layer
    overrides (a dict of parameters, or ``false`` to keep that layer dense). A layer
    without an override is quantized when its ``.scales`` tensor is present, with the
    group size and bits read back from the stored shapes.

    :param source: the file each tensor came from, named by errors about that tensor.
    :raises ModelLoadError: a quantized layer's stored tensors are missing or do not have
        the shapes of any supported quantization of that layer.
    """
    quantization = config.get("quantization")
    if quantization is None:
        legacy = config.get("quantization_config")
        if isinstance(legacy, dict) and legacy.get("quant_method"):
            raise ValueError(
                f"field 'quantization_config.quant_method': '{legacy['quant_method']}' "
                "checkpoints are not supported; convert to MLX affine format "
                "(mlx_lm.convert -q) first"
            )
        return
    if not isinstance(quantization, dict):
        raise ValueError("field 'quantization': expected an object")
    mode = quantization.get("mode", "affine")
    if mode != "affine":
        raise ValueError(f"field 'quantization.mode': '{mode}' is not supported (only 'affine')")
    for key in ("group_size", "bits"):
        if not isinstance(quantization.get(key), int):
            raise ValueError(f"field 'quantization.{key}': expected an int")

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in quantization:
            return quantization[path]
        if not hasattr(module, "to_quantized"):
            return False
        if f"{path}.scales" not in weights:
            packed = weights.get(f"{path}.weight")
            if packed is not None and packed.dtype == mx.uint32:
                raise ModelLoadError(
                    f"{(source or {}).get(f'{path}.weight', 'the checkpoint')}: missing tensor "
                    f"'{path}.scales' (its packed weight '{path}.weight' is there)")
            return False
        return _stored_quantization(path, module.weight.shape, weights, source or {},
                                    quantization["group_size"], quantization["bits"])

    nn.quantize(
        model,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        class_predicate=predicate,
    )


#: The group sizes and bit widths MLX's affine quantization supports.
GROUP_SIZES = (32, 64, 128)
BITS = (1, 2, 3, 4, 5, 6, 8)


def _stored_quantization(
    path: str,
    dense_shape: tuple[int, ...],
    weights: dict[str, mx.array],
    source: Mapping[str, Path],
    group_size: int,
    bits: int,
) -> dict[str, int]:
    """The group size and bits a quantized layer was stored with, read back from the
    shapes of its packed weight (``[out, in * bits / 32]``) and scales (``[out, in /
    group_size]``); an error names the file, the tensor and the shape expected from
    config.json's ``quantization`` against the one found."""
    *outer, in_dims = dense_shape
    weight_name, scales_name = f"{path}.weight", f"{path}.scales"
    where = source.get(scales_name, "the checkpoint")
    if weight_name not in weights:
        raise ModelLoadError(f"{where}: missing tensor '{weight_name}' (its quantization "
                             f"scales '{scales_name}' are there)")
    stored, scales = weights[weight_name], weights[scales_name]
    expected = {
        weight_name: (*outer, in_dims * bits // 32),
        scales_name: (*outer, in_dims // group_size),
    }
    found_bits = found_group = 0
    if stored.ndim == len(dense_shape) and scales.ndim == len(dense_shape):
        if (stored.shape[-1] * 32) % in_dims == 0:
            found_bits = stored.shape[-1] * 32 // in_dims
        if scales.shape[-1] and in_dims % scales.shape[-1] == 0:
            found_group = in_dims // scales.shape[-1]
    for name, ok in (
        (weight_name, found_bits in BITS and tuple(stored.shape[:-1]) == tuple(outer)),
        (scales_name, found_group in GROUP_SIZES and tuple(scales.shape[:-1]) == tuple(outer)),
    ):
        if not ok:
            raise ModelLoadError(
                f"{source.get(name, 'the checkpoint')}: tensor '{name}' has shape "
                f"{tuple(weights[name].shape)}, expected {expected[name]} ({bits}-bit, groups "
                f"of {group_size}, as config.json's 'quantization' says, for a layer of "
                f"shape {tuple(dense_shape)}); is the tensor transposed or from another model?"
            )
    return {"group_size": found_group, "bits": found_bits}


def _check_tensors(
    model: nn.Module, weights: dict[str, mx.array], source: dict[str, Path], where: Path
) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    if missing:
        shown = ", ".join(f"'{name}'" for name in missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        files = sorted({str(f) for f in source.values() if f.suffix == ".safetensors"})
        files = files or [str(where)]
        holder = files[0] if len(files) == 1 else f"{where} (none of {len(files)} weight files)"
        raise ModelLoadError(f"{holder}: missing tensor(s) the model needs: {shown}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        name = unexpected[0]
        raise ModelLoadError(
            f"{source.get(name, where)}: unexpected tensor '{name}'"
            + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else "")
            + "; the checkpoint does not match its config.json"
        )
    for name, param in expected.items():
        if weights[name].shape != param.shape:
            raise ModelLoadError(
                f"{source.get(name, where)}: tensor '{name}' has shape "
                f"{tuple(weights[name].shape)}, the model expects {tuple(param.shape)} "
                "(does config.json match these weights?)"
            )
        dtype = weights[name].dtype
        if param.dtype == mx.uint32 and dtype != mx.uint32:
            wanted = "uint32 (MLX packs quantized weights into uint32 words)"
        elif param.dtype != mx.uint32 and dtype not in FLOAT_DTYPES:
            wanted = "a floating dtype (float16, bfloat16 or float32)"
        else:
            continue
        raise ModelLoadError(
            f"{source.get(name, where)}: tensor '{name}' has dtype {_dtype_name(dtype)}, "
            f"the model expects {wanted}"
        )


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


# -- CPU execution ---------------------------------------------------------------------------


def should_unpack_quantized(model: nn.Module) -> bool:
    """Whether to run this quantized model from float32 weights instead.

    MLX's CPU backend has no BLAS path for quantized matmuls, so packed weights decode an
    order of magnitude slower there (docs/decisions.md). GPUs keep the packed weights. An
    engine's ``cpu_unpack=False`` keeps them packed on the CPU too, for what it loads;
    ``FORETELL_CPU_UNPACK=0`` is the process's default.

    Unpacked, the model computes in float32 from exactly dequantized weights. With
    bfloat16/float16 scales mlx-lm computes in that dtype through MLX's quantized kernel,
    which no dense matmul reproduces, so only the packed path is mlx-lm bit for bit; the
    unpacked one is the closer to the checkpoint's exact (float64) model (docs/decisions.md
    has the measurements).
    """
    if mx.default_device() != mx.cpu or not _cpu_flag("cpu_unpack", "FORETELL_CPU_UNPACK"):
        return False
    packed = [m for _, m in model.named_modules() if isinstance(m, _PACKED)]
    unpacked_bytes = sum(4 * m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits for m in packed)
    return bool(packed) and unpacked_bytes <= CPU_UNPACK_LIMIT


_PACKED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def unpack_quantized(model: nn.Module, dtype: mx.Dtype = mx.float32) -> None:
    """Replace quantized layers by plain ones holding the dequantized weights.

    The dequantization itself runs in ``dtype``: ``mx.dequantize`` computes in the scales'
    dtype, and ``scales * q + biases`` rounded to bfloat16 is a different model from the
    checkpoint's, where in float32 it is exact (bfloat16 or float16 scale times a <= 8-bit
    integer, plus a bias: docs/decisions.md)."""

    def unpack(layer: Any) -> Any:
        if not isinstance(layer, _PACKED):
            return layer
        weight = mx.dequantize(
            layer.weight, layer.scales.astype(dtype), layer.biases.astype(dtype),
            layer.group_size, layer.bits,
        )
        if isinstance(layer, nn.QuantizedEmbedding):
            plain = nn.Embedding(*weight.shape)
        else:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in layer)
            if "bias" in layer:
                plain.bias = layer.bias.astype(dtype)
        plain.weight = weight
        return plain

    model.update_modules(tree_map(unpack, model.leaf_modules(), is_leaf=nn.Module.is_module))


def should_lay_out_input_major() -> bool:
    """Whether float32 weights are laid out input-major at load: on the CPU where OpenBLAS
    is under MLX (:mod:`foretell.platform.blas_layout` says why). An engine's
    ``cpu_transpose=False`` keeps MLX's layout, for what it loads; ``FORETELL_CPU_TRANSPOSE=0``
    is the process's default."""
    from foretell.platform import blas

    return (mx.default_device() == mx.cpu and blas.STATUS.loaded is not None
            and _cpu_flag("cpu_transpose", "FORETELL_CPU_TRANSPOSE"))


def _cpu_flag(setting: str, variable: str) -> bool:
    """An engine's on/off ``setting`` for the CPU (``cpu_unpack``, ``cpu_transpose``), else the
    process's default: on unless ``variable`` is ``0``."""
    chosen = engine_choice(setting)
    if chosen is None:
        return os.environ.get(variable, "1") != "0"
    return bool(chosen)


def fit_to_device(model: nn.Module, vocab_size: int | None = None) -> None:
    """Make a loaded model (or a drafter's head) compute the way this device runs fastest:
    on the CPU quantized weights unpacked to float32 (:func:`should_unpack_quantized`) and
    float32 weights laid out input-major (:func:`should_lay_out_input_major`; ``vocab_size``
    finds a tied head's embedding). Elsewhere it leaves the model as loaded."""
    if should_unpack_quantized(model):
        unpack_quantized(model)
    if should_lay_out_input_major():
        from foretell.platform.blas_layout import lay_out

        lay_out(model, vocab_size)


# -- the entry points --------------------------------------------------------------------


def load_model(
    path: str | Path,
    registry: Registry,
    *,
    lazy: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Model:
    """Build the architecture ``config.json`` names and load its weights.

    :param path: a model directory (config.json, model.safetensors or an index + shards).
    :param registry: where architectures are looked up by ``model_type``.
    :param lazy: leave weights mapped, to be read on first use, instead of reading them now.
    :param progress: called ``(bytes read, bytes total)`` as the weights are read.
    :raises ModelLoadError: for any problem with the directory's files.
    :raises UnknownContribution: when no installed plugin provides the ``model_type``.
    """
    path = Path(path)
    config = read_config(path)
    builder = registry.get(Kind.ARCHITECTURE, config["model_type"]).load()
    config_file = path / CONFIG
    try:
        model = builder(config)
    except UnknownContribution:
        raise
    except (ModelLoadError, ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc
    weights, source = read_weights(path)
    names_before = set(weights)
    try:
        weights = model.sanitize(weights)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: weights do not fit '{config['model_type']}': {exc}") from exc
    for name in set(weights) - names_before:
        source.setdefault(name, path)
    try:
        quantize_like_checkpoint(model, config, weights, source)
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{config_file}: {exc}") from exc
    _check_tensors(model, weights, source, path)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    fit_to_device(model, getattr(model, "vocab_size", None))
    if not lazy:
        materialize(model, progress)
    return model


def materialize(model: nn.Module, progress: Callable[[int, int], None] | None = None) -> None:
    """Read every parameter into memory, reporting bytes as groups of them land."""
    params = [p for _, p in tree_flatten(model.parameters())]
    if progress is None:
        mx.eval(params)
        return
    total, done, group, pending = sum(p.nbytes for p in params), 0, [], 0
    for i, param in enumerate(params):
        group.append(param)
        pending += param.nbytes
        if pending >= 64 << 20 or i == len(params) - 1:
            mx.eval(group)
            done, group, pending = done + pending, [], 0
            progress(done, total)


def load(path: str | Path, *, lazy: bool = False) -> Model:
    """:func:`load_model` with the installed plugins (entry points, env switches apply)."""
    from foretell.plugin.loader import load_plugins

    return load_model(path, load_plugins().registry, lazy=lazy)
