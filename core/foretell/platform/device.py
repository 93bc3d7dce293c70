"""Which device the engine runs on, as the parts that behave differently there ask it, and
the one way engine code reaches the CUDA-only code (:func:`cuda_backend`)."""

from __future__ import annotations

from types import ModuleType


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU now (the CUDA build, with the GPU the default
    device). The verifier's attention and the drafter warm-up differ there (docs/speculation.md)."""
    import mlx.core as mx

    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


def cuda_backend() -> ModuleType | None:
    """:mod:`foretell.platform.cuda`, imported now, where MLX computes on a CUDA GPU; None
    elsewhere. Engine code reaches the CUDA-only code only through here, at run time, so a
    CPU or Metal process never imports it (``tests/core/test_backend_neutral.py``)."""
    if not on_cuda():
        return None
    import foretell.platform.cuda

    return foretell.platform.cuda


def cold_cuda_note() -> str | None:
    """One line for a person about to wait, where MLX has compiled no kernels on this CUDA
    host yet (:func:`foretell.platform.cuda.kernels.cold_note`); else None."""
    cuda = cuda_backend()
    return None if cuda is None else cuda.kernels.cold_note()


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
