"""Per-platform facts the engine needs before it starts.

- :mod:`foretell.platform.blas`: puts an optimized BLAS under MLX on Linux CPU; called
  where the engine starts (``preload()``), never on ``import foretell``;
- :mod:`foretell.platform.device`: ``on_cuda()``, for the parts that run differently on a
  CUDA GPU;
- :mod:`foretell.platform.cuda`: page-locked staging and the driver's copies, for reads
  that land on a CUDA GPU (the block store's);
- :mod:`foretell.platform.kernels`: MLX's run-time compiled kernels on a CUDA GPU, kept
  across reboots and compiled in parallel;
- :mod:`foretell.platform.ptx`: foretell's own CUDA kernels, compiled once with NVRTC and
  kept;
- :func:`cache_home`: where foretell keeps what it makes for itself.

Nothing here runs on import.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """``$XDG_CACHE_HOME/foretell`` (``~/.cache/foretell`` where it is unset or empty): the
    bench's synthetic models, MLX's kept kernels."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "foretell"
