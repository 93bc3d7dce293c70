"""foretell's own CUDA kernels, compiled once with NVRTC and kept on disk.

``mx.fast.cuda_kernel`` wraps a kernel's body in MLX's headers and compiles it with NVRTC
in every process: MLX-CUDA 0.32.4 keeps its own kernels in ``MLX_PTX_CACHE_DIR`` but not
these. On the H200 each of the block store's two kernels (the device digest, the landing
area's placing) took 1.7-2.5 s to ready in every fresh process, and opening a cache tier
3.4-5.5 s (``scripts/kernel_load_probe.py``, docs/block-store.md). Written as complete
``extern "C"`` kernels that need no header, they compile in a fraction of that, once per
source and GPU architecture: :func:`kernel_ptx` keeps the machine code (a cubin, as MLX
compiles its own) under ``<cache home>/kernels/`` and MLX runs it through
``mx.fast.precompiled_cuda_kernel``.

Where NVRTC cannot be found or refuses a source, :func:`kernel_ptx` answers None and the
caller runs its ``mx.fast.cuda_kernel`` form instead; :func:`checked` runs either form
only after its first results equal a reference's. NVRTC comes with MLX's CUDA build (the
``nvidia-cuda-nvrtc`` package it requires); it is looked for where MLX loaded it, in
Python's ``nvidia/*/lib`` directories, and by the loader's own search.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from foretell.platform import cache_home

log = logging.getLogger("foretell.platform")

#: ``on`` or ``auto`` (the default) on a CUDA GPU: run the kept kernels (where NVRTC is
#: found and each passes its check), which a fresh process on the H200 readied in 212 and
#: 1.2 ms against 1.7-3.0 and 1.4-2.7 s for the ``mx.fast.cuda_kernel`` forms
#: (docs/benchmarks.md, 2026-12-05); ``off``: those forms.
ENV = "FORETELL_KEPT_KERNELS"


def enabled() -> bool:
    """Whether :func:`kernel_ptx` offers kept kernels (:data:`ENV`).

    :raises ConfigError: :data:`ENV` holds something else (naming it).
    """
    from foretell.platform.device import device_mode

    return device_mode(ENV, cuda="on", elsewhere="off", choices=("on", "off")) == "on"

_LOCK = threading.Lock()
_NVRTC: list[Any] = []
_PTX: dict[str, bytes | None] = {}


def kernel_ptx(name: str, source: str) -> bytes | None:
    """The compiled ``source`` (a complete CUDA source defining ``extern "C"`` kernel
    ``name``) for this process's GPU: from ``<cache home>/kernels/`` when compiled before,
    else compiled now with NVRTC and kept there (tmp, then rename). None unless
    :func:`enabled`, and where no GPU answers, there is no NVRTC, or NVRTC refuses the
    source (logged)."""
    from foretell.platform import cuda

    if not enabled():
        return None
    arch = cuda.compute_capability()
    if arch is None:
        return None
    key = _key(name, source, arch)
    with _LOCK:
        if key in _PTX:
            return _PTX[key]
        path = kernel_dir() / f"{key}.cubin"
        try:
            found = path.read_bytes()
        except OSError:
            try:
                found = compile_ptx(source, name, arch)
            except Exception as exc:  # noqa: BLE001 - a kept kernel is only ever an option
                log.warning("NVRTC failed on kernel %s: %s", name, exc)
                found = None
            if found is not None:
                _keep(path, found)
        _PTX[key] = found
        return found


def checked(name: str, source: str, kept: Callable[[bytes], Any],
            mismatch: Callable[[Any], str | None], fallback: Callable[[], Any]) -> Any:
    """The launch to use for kernel ``name``: ``kept(compiled)``, the kept form of
    ``source`` (:func:`kernel_ptx`), once ``mismatch(launch)`` finds nothing wrong with its
    results against a reference (it returns what it got otherwise); else ``fallback()``,
    the ``mx.fast.cuda_kernel`` form, with one warning if a kept form was tried, once it
    passes the same check. Any error of the kept form counts as failing its check; a kept
    form that fails it is deleted (:func:`discard`), so a damaged file is compiled afresh
    by the next process instead of failing in every one.

    :raises RuntimeError: the fallback fails its check too (each caller has a slower path
        that needs no kernel: a digest by MLX ops, a read landing piece by piece). A wrong
        digest kernel used to check reads and to digest writes alike could pass everything
        it was shown; no form is used unchecked."""
    compiled = kernel_ptx(name, source)
    if compiled is not None:
        try:
            launch = kept(compiled)  # a damaged image may fail as it loads
            wrong = mismatch(launch)
        except Exception as exc:  # noqa: BLE001 - whatever fails, the kept form is not used
            log.warning("kept kernel %s failed its check (%s: %s); using mx.fast.cuda_kernel",
                        name, type(exc).__name__, exc)
        else:
            if wrong is None:
                return launch
            log.warning("kept kernel %s gave %s on its check; using mx.fast.cuda_kernel",
                        name, wrong)
        discard(name, source)
    launch = fallback()
    wrong = mismatch(launch)
    if wrong is not None:
        raise RuntimeError(f"kernel {name} gave {wrong} on its check")
    return launch


def discard(name: str, source: str) -> None:
    """Forget the kept form of ``source``: deleted from disk, and not offered again in this
    process."""
    from foretell.platform import cuda

    arch = cuda.compute_capability()
    if arch is None:
        return
    key = _key(name, source, arch)
    with _LOCK:
        _PTX[key] = None
    path = kernel_dir() / f"{key}.cubin"
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.debug("kept kernel %s not deleted: %s", path, exc)


def _key(name: str, source: str, arch: tuple[int, int]) -> str:
    """The kept form's file name, less its suffix: the kernel, its source's hash, the GPU's
    architecture (another source or GPU is another file)."""
    digest = hashlib.blake2b(source.encode(), digest_size=8).hexdigest()
    return f"{name}-{digest}-sm_{arch[0]}{arch[1]}"


def kernel_dir() -> Path:
    return cache_home() / "kernels"


def compile_ptx(source: str, name: str, arch: tuple[int, int]) -> bytes | None:
    """NVRTC's machine code (a cubin) for ``source`` on ``sm_<arch>``, as MLX compiles its
    own (a driver older than the NVRTC can still load it, where it could not load that
    NVRTC's PTX); None (logged) if NVRTC is missing or refuses it."""
    lib = nvrtc()
    if lib is None:
        log.info("no NVRTC found: kernel %s runs through mx.fast.cuda_kernel", name)
        return None
    program = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(),
                              0, None, None):
        return None
    try:
        options = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode()]
        result = lib.nvrtcCompileProgram(program, len(options),
                                         (ctypes.c_char_p * len(options))(*options))
        if result:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(program, text)
            log.warning("NVRTC refused kernel %s (result %d): %s", name, result,
                        text.value.decode(errors="replace").strip())
            return None
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(program, ctypes.byref(size)) or not size.value:
            return None
        image = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(program, image):
            return None
        return image.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def nvrtc() -> Any | None:
    """NVRTC's library (``ctypes``), found once per process; None where there is none."""
    if _NVRTC:
        return _NVRTC[0]
    found = None
    for candidate in _nvrtc_candidates():
        try:
            found = ctypes.CDLL(candidate)
            found.nvrtcCreateProgram.argtypes = [
                ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            found.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int,
                                                  ctypes.POINTER(ctypes.c_char_p)]
            for call in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
                getattr(found, call).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
            for call in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
                getattr(found, call).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            found.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            break
        except (OSError, AttributeError):
            found = None
    _NVRTC.append(found)
    return found


def _nvrtc_candidates() -> list[str]:
    """Where NVRTC may be: the copy this process loaded already (MLX's), the ``nvidia``
    packages on Python's path (``nvidia-cuda-nvrtc``: ``nvidia/cu13/lib``,
    ``nvidia/cuda_nvrtc/lib``), then the loader's search by name."""
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            found += sorted({line.split()[-1] for line in maps
                             if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        pass
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry, "nvidia", "*", "lib", "libnvrtc.so*")),
                        reverse=True)
    return found + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


def _keep(path: Path, ptx: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(ptx)
        os.replace(tmp, path)
    except OSError as exc:  # kept or not, this process has it
        log.debug("kernel %s not kept: %s", path.name, exc)
