"""foretell's own CUDA kernels (the landing area's placing, the device digests), compiled once
with NVRTC and kept on disk.

``mx.fast.cuda_kernel`` wraps a kernel's body in MLX's headers and compiles it with NVRTC in
every process, and MLX keeps its own kernels on disk but not these: each fresh process would
wait seconds for each as its cache tier opens (docs/decisions.md, "CUDA-only code"). Written
as a complete ``extern "C"`` kernel that needs no header, each compiles in a fraction of that,
once per source and GPU architecture: :func:`kernel_ptx` keeps the machine code (a cubin, as
MLX compiles its own) under ``<cache home>/kernels/`` and MLX runs it through
``mx.fast.precompiled_cuda_kernel``.

NVRTC comes with MLX's CUDA build (the ``nvidia-cuda-nvrtc`` package it requires); it is
looked for where MLX loaded it, in Python's ``nvidia/*/lib`` directories, and by the loader's
own search. :func:`checked` hands out a kernel only after its first results equal a
reference's; where there is none, its caller takes the path that needs no kernel.
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
from foretell.platform.cuda import driver

log = logging.getLogger("foretell.platform")

_LOCK = threading.Lock()
_NVRTC: list[Any] = []
_PTX: dict[str, bytes | None] = {}


def kernel_ptx(name: str, source: str) -> bytes | None:
    """The compiled ``source`` (a complete CUDA source defining ``extern "C"`` kernel
    ``name``) for this process's GPU: from ``<cache home>/kernels/`` when compiled before,
    else compiled now with NVRTC and kept there (tmp, then rename). None where no GPU
    answers, there is no NVRTC, or NVRTC refuses the source (logged)."""
    arch = driver.compute_capability()
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
            mismatch: Callable[[Any], str | None]) -> Any:
    """The launch for kernel ``name``: ``kept(compiled)``, the kept form of ``source``
    (:func:`kernel_ptx`), once ``mismatch(launch)`` finds nothing wrong with its results
    against a reference (it returns what it got otherwise). Any error counts as failing the
    check; a kept form that fails it is deleted (:func:`discard`), so a damaged file is
    compiled afresh by the next process instead of failing in every one.

    :raises RuntimeError: no compiled form, or it fails its check (the caller takes its
        path that needs no kernel).
    """
    compiled = kernel_ptx(name, source)
    if compiled is None:
        raise RuntimeError(f"kernel {name} has no compiled form (no GPU answers, no NVRTC, "
                           "or NVRTC refused it)")
    try:
        launch = kept(compiled)  # a damaged image may fail as it loads
        wrong = mismatch(launch)
    except Exception as exc:  # noqa: BLE001 - whatever fails, the kept form is not used
        discard(name, source)
        raise RuntimeError(f"kernel {name} failed its check ({type(exc).__name__}: "
                           f"{exc})") from exc
    if wrong is not None:
        discard(name, source)
        raise RuntimeError(f"kernel {name} gave {wrong} on its check")
    return launch


def discard(name: str, source: str) -> None:
    """Forget the kept form of ``source``: deleted from disk, and not offered again in this
    process."""
    arch = driver.compute_capability()
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
        log.info("no NVRTC found: no kept form of kernel %s", name)
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
