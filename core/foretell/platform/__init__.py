"""Per-platform facts the engine needs before it starts.

- :mod:`foretell.platform.blas`: puts an optimized BLAS under MLX on Linux CPU; called
  where the engine starts (``preload()``), never on ``import foretell``;
- :mod:`foretell.platform.device`: ``on_cuda()`` for the parts that run differently on a
  CUDA GPU, and ``cuda_backend()``, the one way to reach the CUDA-only code;
- :mod:`foretell.platform.cuda`: the CUDA-only code (staging and DMA for the block store's
  reads and writes, its landing kernel, MLX's kernels kept and precompiled), imported only
  where MLX computes on a CUDA GPU;
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
