"""Which device the engine runs on, as the parts that behave differently there ask it."""

from __future__ import annotations


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU now (the CUDA build, with the GPU the default
    device). The verifier's attention and the drafter warm-up differ there (docs/speculation.md)."""
    import mlx.core as mx

    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


def cold_cuda_note() -> str | None:
    """One line for a person about to wait, where this host's CUDA driver has compiled
    nothing yet; else None. MLX's first CUDA work on a host makes the driver compile MLX's
    kernel library for the GPU, once: on an H200 the first request of a fresh host's first
    process took 36.6 s and left 180 MiB in ``~/.nv/ComputeCache``, and no later process
    waited (docs/speculation.md, "Fixed shapes on CUDA"). Not a measurement: a GPU whose
    kernels MLX ships compiled would not wait."""
    import os
    from pathlib import Path

    if not on_cuda():
        return None
    if os.environ.get("CUDA_CACHE_DISABLE") == "1":
        return ("foretell: CUDA_CACHE_DISABLE=1, so every run compiles MLX's kernels for the "
                "GPU again (about 40 s on an H200)")
    cache = Path(os.environ.get("CUDA_CACHE_PATH") or Path.home() / ".nv" / "ComputeCache")
    if cache.is_dir() and any(cache.iterdir()):
        return None
    return (f"foretell: the CUDA driver's kernel cache ({cache}) is empty, so this first run "
            "on the host compiles MLX's kernels for the GPU (about 40 s on an H200, once)")


def device_mode(variable: str, *, cuda: str, elsewhere: str, choices: tuple[str, ...]) -> str:
    """A behaviour that differs on CUDA, read once by its caller: ``cuda`` there,
    ``elsewhere`` otherwise, unless the environment variable ``variable`` forces one of
    ``choices`` (``auto`` or unset: the device decides).

    :raises ConfigError: naming ``variable`` when it holds anything else.
    """
    import os

    from foretell.errors import ConfigError

    forced = os.environ.get(variable, "").strip() or "auto"
    if forced == "auto":
        return cuda if on_cuda() else elsewhere
    if forced not in choices:
        raise ConfigError(variable, [f"{forced!r} is not one of auto, {', '.join(choices)}"])
    return forced
