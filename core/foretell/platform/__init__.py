"""Per-platform facts the engine needs before it starts.

- :mod:`foretell.platform.blas`: puts an optimized BLAS under MLX on Linux CPU; called
  where the engine starts (``preload()``), never on ``import foretell``;
- :mod:`foretell.platform.device`: ``on_cuda()``, for the parts that run differently on a
  CUDA GPU;
- :mod:`foretell.platform.cuda`: page-locked staging and the driver's copies, for reads
  that land on a CUDA GPU (the block store's).

Nothing here runs on import.
"""
