"""What readying the block store's two CUDA kernels costs a fresh process (opening the cache
tier on the H200 went from 0.05 s to 3.4-5.5 s once they existed): the device digest's and
the landing area's, each timed on its own, with what MLX keeps on disk for them listed.
Run it twice on a CUDA host: ``python scripts/kernel_load_probe.py`` (the second run should
find both compiled); it lists foretell's kept cubins too (unless ``FORETELL_KEPT_KERNELS=off``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import mlx.core as mx

from foretell.platform import cuda, kernels, ptx
from foretell.store import digest


def timed(label: str, action) -> None:
    start = time.perf_counter()
    action()
    print(f"  {label:34s} {(time.perf_counter() - start) * 1e3:9.1f} ms")


def listed(label: str, folder: str | Path | None, named: str = "") -> None:
    if folder is not None and Path(folder).is_dir():
        print(f"  {label}:", sorted(p.name for p in Path(folder).iterdir() if named in p.name))


def main() -> None:
    kept = kernels.keep_compiled_kernels()
    print(f"MLX_PTX_CACHE_DIR={os.environ.get(kernels.PTX_CACHE)}, "
          f"{ptx.ENV}={os.environ.get(ptx.ENV, 'off')}")
    listed("kept by MLX", kept, "foretell")
    listed("kept by foretell", ptx.kernel_dir())
    timed("driver, pinned arena", cuda.gpu_landing)
    timed("first MLX op on the GPU", lambda: mx.eval(mx.zeros((4,)) + 1))
    timed("digest.prepare (kernel)", lambda: digest.prepare(1 << 20))
    timed("digest again (other words)", lambda: digest.digests([mx.ones((1 << 21,), mx.uint32)]))
    area = cuda.landing()
    timed("landing area: 64 MiB", lambda: area.reserve(64 << 20))
    timed("landing kernel: first placing", lambda: area.prepare(64 << 20))
    listed("kept by MLX after", kept, "foretell")
    listed("kept by foretell after", ptx.kernel_dir())


if __name__ == "__main__":
    main()
