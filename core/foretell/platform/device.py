"""Which device the engine runs on, as the parts that behave differently there ask it."""

from __future__ import annotations


def on_cuda() -> bool:
    """Whether MLX computes on a CUDA GPU now (the CUDA build, with the GPU the default
    device). The verifier's attention and the drafter warm-up differ there (docs/speculation.md)."""
    import mlx.core as mx

    return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu


_QUEUE_EACH_STEP: bool | None = None


def queues_each_step() -> bool:
    """Whether a drafter queues each draft step on the device as soon as it is built
    (``async_eval``), so the device computes step i while the host builds step i + 1.

    On CUDA ``async_eval`` returns at once, so the steps overlap; MLX's CPU ``async_eval``
    returns only near a graph's end, so there a draft is queued once, whole, by the
    verifier. ``FORETELL_DRAFT_QUEUE=step|round`` forces either (for measuring)."""
    global _QUEUE_EACH_STEP
    if _QUEUE_EACH_STEP is None:
        import os

        forced = os.environ.get("FORETELL_DRAFT_QUEUE", "auto")
        _QUEUE_EACH_STEP = forced == "step" or (forced != "round" and on_cuda())
    return _QUEUE_EACH_STEP
