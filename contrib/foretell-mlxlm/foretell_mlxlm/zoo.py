"""Which ``model_type`` strings mlx-lm serves, read from its installed files without
importing it (``foretell plugins`` lists plugins without loading MLX or mlx-lm)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: Modules of ``mlx_lm.models`` that are building blocks, not architectures.
HELPERS = frozenset({
    "activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
    "rope_utils", "ssm", "switch_layers",
})

#: ``model_type`` values mlx-lm maps onto another module (``mlx_lm.utils.MODEL_REMAPPING``
#: of the pinned version; a test keeps the two equal).
REMAPPED = {
    "mistral": "llama",
    "llava": "mistral3",
    "phi-msft": "phixtral",
    "falcon_mamba": "mamba",
    "joyai_llm_flash": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen2_5_vl": "qwen2_vl",
    "minimax_m2": "minimax",
    "iquestcoder": "llama",
    "xverse": "llama",
    "gemma4_unified": "gemma4",
    "deepseek_v41_text": "deepseek_v41",
}


def models_dir() -> Path | None:
    """``mlx_lm/models`` of the installed mlx-lm, or None where it is not installed."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "models"


def modules() -> list[str]:
    """Every architecture module of the installed mlx-lm, by file name."""
    folder = models_dir()
    if folder is None:
        return []
    names = (p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    return sorted(n for n in names if n not in HELPERS)


def model_types() -> dict[str, str]:
    """``{model_type: module}``: each module under its own name, plus mlx-lm's aliases."""
    found = {name: name for name in modules()}
    found.update({alias: module for alias, module in REMAPPED.items() if module in found})
    return dict(sorted(found.items()))
