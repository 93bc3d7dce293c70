"""Which device the engine runs on, as the parts that behave differently there ask it."""

from __future__ import annotations


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU now (the CUDA build, with the GPU the default
    device). The verifier's attention and the drafter warm-up differ there (docs/speculation.md)."""
    import mlx.core as mx

    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


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
