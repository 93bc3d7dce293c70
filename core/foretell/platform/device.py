"""Which device the engine runs on, as the parts that behave differently there ask it."""

from __future__ import annotations


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU now (the CUDA build, with the GPU the default
    device). The verifier's attention and the drafter warm-up differ there (docs/speculation.md)."""
    import mlx.core as mx

    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


def cold_cuda_note() -> str | None:
    """One line for a person about to wait, where MLX has compiled no kernels on this CUDA
    host yet; else None. Points MLX at foretell's kept kernel directory first
    (:func:`foretell.platform.kernels.keep_compiled_kernels`): its having no compiled kernel
    is what makes a first run wait. The CUDA driver's own cache does not matter much: emptied
    alone, the next run took 2.6 s against 2.3 (docs/benchmarks.md, "A fresh CUDA host's
    first run")."""
    from foretell.platform.kernels import keep_compiled_kernels

    kept = keep_compiled_kernels()
    if kept is None or (kept.is_dir() and any(kept.glob("*.ptx"))):
        return None
    return (f"foretell: MLX has compiled no kernels for this GPU yet ({kept}), so this first "
            "run compiles them (about 75 s on an H200, once; later runs reuse them)")


def on_cpu() -> bool:
    """Whether MLX computes on the CPU now (its default device)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def device_mode(variable: str, *, cuda: str, elsewhere: str, choices: tuple[str, ...],
                cpu: str | None = None) -> str:
    """A behaviour that differs by device, read once by its caller: ``cuda`` on a CUDA GPU,
    ``cpu`` (when given) on the CPU, ``elsewhere`` otherwise, unless the environment variable
    ``variable`` forces one of ``choices`` (``auto`` or unset: the device decides).

    :raises ConfigError: naming ``variable`` when it holds anything else.
    """
    import os

    from foretell.errors import ConfigError

    forced = os.environ.get(variable, "").strip() or "auto"
    if forced == "auto":
        if cpu is not None and on_cpu():
            return cpu
        return cuda if on_cuda() else elsewhere
    if forced not in choices:
        raise ConfigError(variable, [f"{forced!r} is not one of auto, {', '.join(choices)}"])
    return forced
