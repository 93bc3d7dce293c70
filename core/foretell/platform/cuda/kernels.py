"""The kernels MLX compiles on a CUDA GPU: kept across reboots, and compiled in parallel.

MLX's CUDA build compiles some kernels at run time with NVRTC and keeps them in
``MLX_PTX_CACHE_DIR``, by default under the temporary directory (``/tmp/mlx/<version>/ptx``),
which a reboot or a tmp cleaner empties. The costly ones are its quantized matmuls for 8 or
more rows (``qmm_sm80``): one kernel per weight width, group size, activation dtype and row
tile (16, 32 or 64 rows), half a minute of one CPU core each, one after another inside the
first requests. So:

- :func:`keep_compiled_kernels` points ``MLX_PTX_CACHE_DIR``, where the user has not set it,
  at ``<cache home>/foretell/mlx-kernels/mlx-<version>-sm_<arch>``: one directory per MLX
  version and GPU architecture, since MLX names an entry by kernel and shape only.
- :func:`precompile` starts compiling a model's quantized matmuls, every row tile, in parallel
  worker processes, each into a directory of its own; :func:`wait` merges those into the
  kept one file by file (tmp, then rename; nothing overwritten). ``load`` starts the
  target's as the weights land, a drafter's warm-up starts its own and waits for all, as
  does each request: the engine's first forwards then find them compiled.

What it buys: docs/decisions.md, "CUDA-only code".
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

from foretell.platform import cache_home
from foretell.platform.cuda import driver

#: Rows of a quantized matmul that pick each of ``qmm_sm80``'s row tiles (MLX 0.32: the
#: tile is the next power of two of the rows, between 16 and 64; fewer than 8 rows take a
#: precompiled kernel).
TILE_ROWS = (16, 32, 64)
#: The variable MLX reads, once, at its first run-time compile.
PTX_CACHE = "MLX_PTX_CACHE_DIR"
#: ``auto`` (or unset) and ``on``: precompile (this module runs on a CUDA GPU only, where
#: ``auto`` is ``on``; ``on`` also runs the workers where the tests force it); ``off``: never,
#: for an operator whose host cannot spare the workers' memory or cores.
PRECOMPILE = "FORETELL_PRECOMPILE_KERNELS"


@attrs.frozen
class QuantizedMatmul:
    """What selects a quantized matmul kernel, with one layer's sizes to call it on."""

    bits: int
    group_size: int
    mode: str
    dtype: str
    #: Output features and input features of one such layer (``transpose=True``).
    outputs: int
    inputs: int

    @property
    def key(self) -> tuple[int, int, str, str]:
        return self.bits, self.group_size, self.mode, self.dtype


def keep_compiled_kernels() -> Path:
    """The directory MLX keeps its compiled kernels in, setting ``MLX_PTX_CACHE_DIR`` to
    foretell's kept one where the user has not set it. Takes effect if it runs before MLX's
    first run-time compile in the process."""
    chosen = os.environ.get(PTX_CACHE)
    if chosen:
        return Path(chosen)
    import mlx.core as mx

    arch = driver.compute_capability()
    name = f"mlx-{mx.__version__}-sm_{arch[0]}{arch[1]}" if arch else f"mlx-{mx.__version__}"
    folder = cache_home() / "mlx-kernels" / name
    os.environ[PTX_CACHE] = str(folder)
    return folder


def cold_note() -> str | None:
    """One line for a person about to wait, where MLX has compiled no kernels on this host
    yet (:func:`keep_compiled_kernels`'s directory holds none); else None. MLX's having no
    compiled kernel is what makes a first run wait, not the CUDA driver's own cache."""
    kept = keep_compiled_kernels()
    if kept.is_dir() and any(kept.glob("*.ptx")):
        return None
    return (f"foretell: MLX has compiled no kernels for this GPU yet ({kept}), so this first "
            "run compiles them (a minute or more, once; later runs reuse them)")


def quantized_matmuls(*owners: Any) -> list[QuantizedMatmul]:
    """One entry per kind of quantized matmul in ``owners`` (MLX modules, or objects holding
    them as attributes, as a draft provider holds its model), with the first such layer's
    sizes."""
    import mlx.nn as nn

    found: dict[tuple, QuantizedMatmul] = {}
    for module in _modules(owners):
        for _name, layer in module.named_modules():
            if not isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                continue
            rows, packed = layer.weight.shape[-2:]
            kind = QuantizedMatmul(
                bits=layer.bits, group_size=layer.group_size,
                mode=getattr(layer, "mode", "affine"), dtype=str(layer.scales.dtype).split(".")[-1],
                outputs=rows, inputs=packed * 32 // layer.bits)
            found.setdefault(kind.key, kind)
    return list(found.values())


def precompile(*owners: Any) -> int:
    """Start compiling the quantized matmuls of ``owners`` at every row tile, one worker
    process each, all at once, and return how many started; :func:`wait` lands them. Nothing
    starts with ``FORETELL_PRECOMPILE_KERNELS=off``, where no Python process can be started,
    or for a kernel marked compiled before or on its way. Until then the engine computes as
    ever: a kernel it needs first compiles in the engine's process too, and a worker's never
    overwrites it."""
    from foretell.platform.device import device_mode

    if device_mode(PRECOMPILE, cuda="on", elsewhere="off", choices=("on", "off")) == "off":
        return 0
    kept = keep_compiled_kernels()
    started = 0
    with _LOCK:
        pending = {worker.marker for worker in _PENDING}
        jobs = [(kind, rows) for kind in quantized_matmuls(*owners) for rows in TILE_ROWS
                if _marker(kind, rows) not in pending and not (kept / _marker(kind, rows)).exists()]
        for kind, rows in jobs:
            worker = _start(kind, rows, kept)
            if worker is None:
                break
            _PENDING.append(worker)
            started += 1
    return started


def wait() -> int:
    """Wait for every worker :func:`precompile` started; merge into the kept directory what
    each compiled and mark its kernel done there. Returns how many compiled and were kept (a
    worker that failed, or a kept directory that cannot be written, costs its time only: the
    engine compiles that kernel when it needs it)."""
    compiled = 0
    with _LOCK:
        while _PENDING:
            worker = _PENDING.pop(0)
            try:
                if worker.process.wait() == 0:
                    merge(worker.own, worker.kept)
                    worker.kept.mkdir(parents=True, exist_ok=True)
                    (worker.kept / worker.marker).touch()
                    compiled += 1
            except OSError:
                pass  # a full or read-only disk: not kept; the engine compiles it when needed
            finally:
                shutil.rmtree(worker.own, ignore_errors=True)
    return compiled


@attrs.frozen
class _Worker:
    process: Any
    own: Path
    marker: str
    kept: Path


_PENDING: list[_Worker] = []
_LOCK = threading.Lock()


def _abandon() -> None:
    """At exit, workers nobody waited for are stopped and their directories removed."""
    for worker in _PENDING:
        worker.process.kill()
        worker.process.wait()
        shutil.rmtree(worker.own, ignore_errors=True)
    _PENDING.clear()


atexit.register(_abandon)  # nothing to do unless workers were left running


def _start(kind: QuantizedMatmul, rows: int, kept: Path) -> _Worker | None:
    """One worker compiling ``kind`` at ``rows`` rows into a directory of its own; None where
    none can start (no Python to run in an embedded interpreter, no temporary directory)."""
    try:
        own = Path(tempfile.mkdtemp(prefix="foretell-kernels-"))
    except OSError:
        return None
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _WORKER, *_arguments(kind, rows)],
            env=dict(os.environ, **{PTX_CACHE: str(own), PRECOMPILE: "off"}),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        shutil.rmtree(own, ignore_errors=True)
        return None
    return _Worker(process, own, _marker(kind, rows), kept)


#: What a worker runs (``-c``: ``-m`` on a module its package imports runs it twice).
_WORKER = ("import sys; from foretell.platform.cuda.kernels import compile_one; "
           "compile_one(sys.argv[1:])")


def _marker(kind: QuantizedMatmul, rows: int) -> str:
    return (f"foretell-qmm-b{kind.bits}-g{kind.group_size}-{kind.mode}-{kind.dtype}-"
            f"{kind.outputs}x{kind.inputs}-r{rows}.done")


def merge(source: Path, kept: Path) -> int:
    """Copy each file of ``source`` that ``kept`` lacks into ``kept``, each landing whole
    (written beside it, then renamed, so MLX never reads half a file); returns how many
    landed."""
    if not source.is_dir():
        return 0
    kept.mkdir(parents=True, exist_ok=True)
    landed = 0
    for path in sorted(source.iterdir()):
        target = kept / path.name
        if not path.is_file() or target.exists():
            continue
        partial = kept / f".{path.name}.{os.getpid()}.tmp"
        partial.write_bytes(path.read_bytes())
        os.replace(partial, target)
        landed += 1
    return landed


def _arguments(kind: QuantizedMatmul, rows: int) -> list[str]:
    return [str(value) for value in (kind.bits, kind.group_size, kind.mode, kind.dtype,
                                     kind.outputs, kind.inputs, rows)]


def _modules(owners: Iterable[Any]) -> Iterator[Any]:
    import mlx.nn as nn

    for owner in owners:
        if isinstance(owner, nn.Module):
            yield owner
        else:  # a provider of slots (no __dict__) holds no module this finds
            held = getattr(owner, "__dict__", {}).values()
            yield from (value for value in held if isinstance(value, nn.Module))


def compile_one(argv: list[str]) -> None:
    """A worker: one quantized matmul of ``rows`` rows, evaluated (so MLX compiles it)."""
    import mlx.core as mx

    bits, group_size, mode, dtype, outputs, inputs, rows = argv
    bits, group_size, outputs, inputs, rows = map(int, (bits, group_size, outputs, inputs, rows))
    dtype = getattr(mx, dtype)
    weight = mx.zeros((outputs, inputs), dtype=dtype)
    packed = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
    x = mx.zeros((rows, inputs), dtype=dtype)
    mx.eval(mx.quantized_matmul(x, *packed, transpose=True, group_size=group_size, bits=bits,
                                mode=mode))

