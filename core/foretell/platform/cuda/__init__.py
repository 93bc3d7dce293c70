"""foretell's CUDA-only code, in one place: imported only where MLX computes on a CUDA GPU.

Engine code reaches it through :func:`foretell.platform.device.cuda_backend`, which answers
this package there and None elsewhere, so a CPU or Metal process never imports it. Each part
is kept for what it buys on a figure a user sees (docs/decisions.md, "CUDA-only code"):

- :mod:`.driver`: reads that land on the GPU by DMA from page-locked staging (``ctypes`` on
  ``libcuda.so.1``), the driver loaded once per process;
- :mod:`.areas`: the landing area a restore lands whole in, placed into the tensors by one
  kernel, and the page-locked area a write gathers a cache's tensors into by DMA;
- :mod:`.digests`: a restored entry's device digests in one kernel launch;
- :mod:`.nvrtc`: those two kernels compiled once with NVRTC and kept on disk;
- :mod:`.kernels`: MLX's own run-time compiled kernels kept across reboots, and a model's
  quantized matmuls compiled in parallel worker processes.

Importing it loads neither the driver nor MLX.
"""

from foretell.platform.cuda import areas, digests, driver, kernels, nvrtc

__all__ = ["areas", "digests", "driver", "kernels", "nvrtc"]
