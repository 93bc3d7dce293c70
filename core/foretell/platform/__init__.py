"""Per-platform facts the engine needs before it starts.

- :mod:`foretell.platform.blas`: puts an optimized BLAS under MLX on Linux CPU; called
  where the engine starts (``preload()``), never on ``import foretell``;
- :mod:`foretell.platform.device`: ``on_cuda()``, for the parts that run differently on a
  CUDA GPU.

Nothing here runs on import.
"""
