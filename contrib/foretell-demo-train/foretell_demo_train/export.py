"""Model directories: full-precision (bf16) HF checkpoints that transformers loads, and
MLX affine-quantized checkpoints laid out as ``mlx_lm.convert -q`` writes them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from . import quantize as Q
from .models import ModelSpec, hf_config
from .tokenizer import save_hf

_DTYPES = {np.dtype(np.uint16): "BF16", np.dtype(np.uint32): "U32", np.dtype(np.float32): "F32"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], fmt: str) -> None:
    """Minimal safetensors writer; uint16 arrays are bfloat16 bit patterns."""
    header: dict = {"__metadata__": {"format": fmt}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


def state_numpy(module: torch.nn.Module | dict) -> dict[str, np.ndarray]:
    sd = module if isinstance(module, dict) else module.state_dict()
    return {k: v.detach().float().cpu().numpy() for k, v in sd.items()}


#: HumanEval's stop sequences: a completion ends with the top-level unit it is in.
STOP_STRINGS = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def generation_config(eos_id: int) -> dict:
    return {"eos_token_id": eos_id, "pad_token_id": eos_id, "bos_token_id": None,
            "do_sample": False, "max_new_tokens": 256, "stop_strings": STOP_STRINGS}


def _write_common(out: Path, config: dict, tokenizer, eos_id: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(eos_id), indent=2) + "\n")
    save_hf(tokenizer, out, config["max_position_embeddings"])


def export_bf16(out: Path, spec: ModelSpec, state: dict[str, np.ndarray], tokenizer,
                eos_id: int, extra_config: dict | None = None) -> None:
    config = {**hf_config(spec, eos_id), **(extra_config or {})}
    _write_common(out, config, tokenizer, eos_id)
    write_safetensors(out / "model.safetensors",
                      {k: Q.f32_to_bf16_bits(v) for k, v in state.items()}, "pt")


def export_quantized(out: Path, spec: ModelSpec, state: dict[str, np.ndarray], bits: int,
                     tokenizer, eos_id: int, extra_config: dict | None = None) -> int:
    """Write an mlx-lm quantized model dir; returns the weight file size in bytes."""
    qcfg = {"group_size": Q.GROUP_SIZE, "bits": bits, "mode": "affine"}
    config = {**hf_config(spec, eos_id), **(extra_config or {}),
              "quantization": dict(qcfg), "quantization_config": dict(qcfg)}
    _write_common(out, config, tokenizer, eos_id)
    path = out / "model.safetensors"
    write_safetensors(path, Q.quantize_state(state, bits), "mlx")
    return path.stat().st_size


def export_mtp(out: Path, state: dict[str, np.ndarray], bits: int | None) -> int:
    """mtp.safetensors beside the target's weights (mlx-lm only globs model*.safetensors)."""
    path = out / "mtp.safetensors"
    if bits:
        tensors = Q.quantize_state(state, bits)
    else:
        tensors = {k: Q.f32_to_bf16_bits(v) for k, v in state.items()}
    write_safetensors(path, tensors, "mlx" if bits else "pt")
    return path.stat().st_size


def quantized_size(state: dict[str, np.ndarray], bits: int | None) -> int:
    """Bytes the tensors take in a checkpoint with ``bits`` (None: bf16)."""
    total = 0
    for name, w in state.items():
        if bits and Q.quantizable(name, w.shape):
            rows, cols = w.shape
            total += rows * cols * bits // 8 + 2 * 2 * rows * (cols // Q.GROUP_SIZE)
        else:
            total += w.size * 2
    return total


def write_training_json(out: Path, info: dict) -> None:
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
