"""Put an optimized BLAS under MLX on Linux CPU, before MLX is imported.

MLX's Linux CPU wheel links the reference BLAS (~2.5 GFLOP/s matmul on a 2-core dev box);
OpenBLAS is 16-23x faster there for M >= 16 rows, which is what prefill and verification
run (docs/blas.md). MLX calls the standard ``cblas_sgemm`` symbol, so a library loaded
``RTLD_GLOBAL`` *before* ``libmlx.so`` wins symbol resolution, with no rebuild and no
``LD_PRELOAD``. :func:`preload` does that once, where the engine starts (the first use
of ``foretell.load`` / ``foretell.Engine``, the CLI's model commands, the bench's workers),
never on ``import foretell``, and records what happened in :data:`STATUS`.

``FORETELL_BLAS=reference`` keeps MLX's own BLAS; ``FORETELL_BLAS=/path/libblas.so`` loads
that library instead of the ``cmeel-openblas`` wheel, and a named library that cannot be
used is a :class:`~foretell.errors.ConfigError`, not a silent fallback. On macOS MLX uses
Accelerate and on CUDA matmuls run on the GPU, so this is a no-op there and harmless
respectively.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from importlib import metadata
from pathlib import Path

import attrs

from foretell.errors import ConfigError

ENV = "FORETELL_BLAS"

#: OpenBLAS builds that are not DYNAMIC_ARCH run one kernel set; on a CPU without these
#: flags the first matmul dies with SIGILL (cmeel-openblas 0.3.31's x86_64 wheel is
#: SKYLAKEX-only), so a build is used only when /proc/cpuinfo shows what its core needs.
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
CORE_NEEDS: dict[str, frozenset[str]] = {
    "SKYLAKEX": _AVX512,
    "COOPERLAKE": _AVX512 | {"avx512_bf16"},
    "SAPPHIRERAPIDS": _AVX512 | {"avx512_bf16", "amx_bf16"},
    "HASWELL": frozenset({"avx2", "fma"}),
    "ZEN": frozenset({"avx2", "fma"}),
    "SANDYBRIDGE": frozenset({"avx"}),
    "ARMV8SVE": frozenset({"sve"}),
    "NEOVERSEV1": frozenset({"sve"}),
    "NEOVERSEV2": frozenset({"sve2"}),
    "A64FX": frozenset({"sve"}),
    **{core: frozenset() for core in ("PRESCOTT", "CORE2", "NEHALEM", "ARMV8", "NEOVERSEN1")},
}


@attrs.frozen(kw_only=True)
class BlasStatus:
    """What :func:`preload` did: ``loaded`` is the library now under MLX, else ``None``
    and ``reason`` says why MLX kept the BLAS it links."""

    loaded: str | None
    reason: str
    core: str | None = None
    threads: int | None = None

    def describe(self) -> str:
        if self.loaded is None:
            return f"reference (MLX's own): {self.reason}"
        return f"OpenBLAS {self.core}, {self.threads} thread(s): {self.loaded}"

    def to_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


NOT_ATTEMPTED = BlasStatus(
    loaded=None, reason="not attempted (foretell.platform.blas.preload() not called)"
)
STATUS = NOT_ATTEMPTED


def preload() -> BlasStatus:
    """Load an optimized BLAS globally if this is Linux and MLX is not imported yet.

    :raises ConfigError: ``FORETELL_BLAS`` names a library that is missing or unusable.
    """
    global STATUS
    if STATUS.loaded is not None:
        return STATUS
    STATUS = _preload(os.environ.get(ENV, "").strip())
    return STATUS


class SlowBlasWarning(RuntimeWarning):
    """MLX runs on the CPU with its reference BLAS because it was imported before foretell."""


IMPORTED_TOO_LATE = (
    "mlx was imported before foretell started its engine, so its BLAS was already bound "
    "(call foretell.load() or foretell.platform.blas.preload() before importing mlx)"
)


def warn_if_bound_too_late(device_is_cpu: bool) -> None:
    """Warn once when a CPU run will use MLX's reference BLAS only because of import order:
    every matmul is then several times slower, and nothing else would say so."""
    global _warned
    if STATUS is NOT_ATTEMPTED:
        preload()  # the engine was reached without foretell.load(): bind now if still possible
    if device_is_cpu and STATUS.reason == IMPORTED_TOO_LATE and not _warned:
        _warned = True
        warnings.warn(
            "foretell: MLX was imported before foretell started its engine, so it runs on "
            "the CPU with its reference BLAS (prefill several times slower, docs/blas.md). "
            "Call foretell.load() (or foretell.platform.blas.preload()) before importing mlx or mlx_lm.",
            SlowBlasWarning,
            stacklevel=3,
        )


_warned = False


def _preload(choice: str) -> BlasStatus:
    if not sys.platform.startswith("linux"):
        return BlasStatus(loaded=None, reason=f"not Linux ({sys.platform}): MLX's BLAS is used")
    if choice == "reference":
        return BlasStatus(loaded=None, reason=f"{ENV}=reference")
    if "mlx.core" in sys.modules:
        return BlasStatus(loaded=None, reason=IMPORTED_TOO_LATE)
    if choice:
        return _load_named(Path(choice))
    path = _cmeel_openblas()
    if path is None:
        return BlasStatus(loaded=None, reason="the cmeel-openblas wheel is not installed")
    return _load(path, explicit=False)


def _load_named(path: Path) -> BlasStatus:
    """The library the user named, or an error: they asked for it, so running on another
    BLAS in silence would hide that their setting does nothing."""
    status = (
        _load(path, explicit=True)
        if path.is_file()
        else BlasStatus(loaded=None, reason=f"{path}: no such file")
    )
    if status.loaded is None:
        raise ConfigError(ENV, [
            f"{status.reason}; unset {ENV} to use the OpenBLAS foretell ships, or set "
            f"{ENV}=reference for MLX's own BLAS"
        ])
    return status


def _cmeel_openblas() -> Path | None:
    try:
        dist = metadata.distribution("cmeel-openblas")
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name == "libopenblas.so.0":
            return Path(dist.locate_file(file))
    return None


def _load(path: Path, *, explicit: bool) -> BlasStatus:
    try:
        lib = _dlopen_local(path)
    except OSError as exc:
        return BlasStatus(loaded=None, reason=f"could not load {path}: {exc}")
    if not hasattr(lib, "cblas_sgemm"):
        return BlasStatus(loaded=None, reason=f"{path} has no cblas_sgemm")
    core = _openblas_core(lib)
    unsupported = _unsupported(core, explicit=explicit)
    if unsupported:
        return BlasStatus(loaded=None, reason=f"{path}: {unsupported}", core=core)
    # Promote the already-loaded library to the global scope: MLX binds to it from here on.
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return BlasStatus(loaded=str(path), reason="loaded", core=core, threads=_set_threads(lib))


def _dlopen_local(path: Path) -> ctypes.CDLL:
    """Open the library without exporting its symbols (that waits for the CPU check).

    Wheels of OpenBLAS link ``libgfortran.so.5``, which many Linux installs lack; the
    gfortran runtime that MLX's or numpy's wheel vendors is then used in its place.
    """
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        if "libgfortran.so.5" not in str(exc) or not _load_vendored_gfortran():
            raise
    return ctypes.CDLL(str(path))


def _load_vendored_gfortran() -> bool:
    """Load a wheel-vendored libgfortran under the soname ``libgfortran.so.5``.

    auditwheel renames the vendored copy's soname (``libgfortran-f7379c93.so.5.0.0``), so the
    dynamic linker would not match it to OpenBLAS's ``NEEDED libgfortran.so.5``. A copy with
    the original soname written back, in an anonymous in-memory file, is matched: nothing is
    written to disk and the wheel's files stay untouched.
    """
    for source in _vendored_gfortrans():
        data = source.read_bytes()
        mangled = source.name.encode() + b"\0"
        if data.count(mangled) != 1:
            continue
        for sibling in source.parent.glob("libquadmath-*.so*"):
            ctypes.CDLL(str(sibling))  # its mangled soname satisfies the copy's NEEDED
        fd = os.memfd_create("libgfortran.so.5")
        os.write(fd, data.replace(mangled, b"libgfortran.so.5".ljust(len(mangled), b"\0")))
        try:
            ctypes.CDLL(f"/proc/self/fd/{fd}", mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        finally:
            os.close(fd)  # the mapping keeps the memory alive
        return True
    return False


def _vendored_gfortrans() -> list[Path]:
    found = []
    for name in ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "numpy", "scipy"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        found += [
            Path(dist.locate_file(f))
            for f in dist.files or ()
            if f.name.startswith("libgfortran-") and ".so.5" in f.name
        ]
    return found


def _openblas_core(lib: ctypes.CDLL) -> str | None:
    """The kernel set an OpenBLAS build runs ("ZEN", "SKYLAKEX", ...); None if not OpenBLAS."""
    if not hasattr(lib, "openblas_get_corename"):
        return None
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return (lib.openblas_get_corename() or b"").decode().upper() or None


def _unsupported(core: str | None, *, explicit: bool) -> str | None:
    """Why this CPU cannot run ``core``'s kernels, or None when it can."""
    if core is None or core not in CORE_NEEDS:
        # A library the user named is theirs to vouch for; an unknown wheel build is not.
        if explicit:
            return None
        return f"unknown OpenBLAS core {core!r}, not known to run on this CPU"
    missing = CORE_NEEDS[core] - cpu_flags()
    if missing:
        return f"built for {core}; this CPU lacks {', '.join(sorted(missing))}"
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 ``flags``, Arm ``Features``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _set_threads(lib: ctypes.CDLL) -> int | None:
    """One OpenBLAS thread unless ``OPENBLAS_NUM_THREADS`` says otherwise.

    MLX runs each matmul on its own CPU-stream thread beside Python's; on the 2-core box a
    second OpenBLAS thread made matmul 2-25x *slower* (spin-waiting workers fighting those
    threads for cores, docs/blas.md). A per-library call, not the env var, so numpy's own
    OpenBLAS in the same process keeps its setting.
    """
    if not hasattr(lib, "openblas_set_num_threads"):
        return None
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return int(lib.openblas_get_num_threads())
    lib.openblas_set_num_threads(1)
    return 1
