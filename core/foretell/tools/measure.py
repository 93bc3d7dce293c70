"""What every benchmark shares: the clock, the machine's description, prompts, portable JSON.

``foretell bench`` (:mod:`foretell.tools.bench`), its speculation and cache rows
(:mod:`foretell.tools.bench_spec`, :mod:`foretell.tools.bench_cache`) and the scripts in
``benchmarks/`` time runs and describe the machine through these, so every table measures
the same way.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import attrs

from foretell.platform import cache_home

#: Default synthetic cache: random weights are made once per (shape, dtype).
CACHE_DIR = cache_home() / "bench"

#: A runner: yields how many tokens each step produced; may return extras for the table.
Steps = Generator[int, None, "dict[str, Any] | None"]


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values (a phase that ran nothing)."""
    return statistics.median(values) if values else float("nan")


@attrs.frozen
class Timing:
    prefill_tps: float
    decode_tps: float
    ttft_s: float
    generated: int
    extras: dict[str, Any] = attrs.field(factory=dict)


def timed(call: Callable[..., Any], seconds: list[float]) -> Callable[..., Any]:
    """``call``, appending how long each call took to ``seconds`` (for a bench or a probe
    that puts it in place of a function to see where time goes)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - begin)
    return run


def time_run(steps: Steps, prompt_tokens: int) -> Timing:
    """Clock a runner the same way for both sides: prefill is the prompt over the time to
    the first token; decode is the tokens after the first step over the time after it."""
    started = time.perf_counter()
    first_at = None
    first_step = generated = 0
    extras: dict[str, Any] = {}
    try:
        while True:
            produced = next(steps)
            if first_at is None:
                first_at, first_step = time.perf_counter(), produced
            generated += produced
    except StopIteration as done:
        extras = done.value or {}
    ended = time.perf_counter()
    first_at = first_at if first_at is not None else ended
    ttft = first_at - started
    decode_time = ended - first_at
    return Timing(
        prefill_tps=prompt_tokens / ttft if ttft > 0 else 0.0,
        decode_tps=(generated - first_step) / decode_time if decode_time > 0 else 0.0,
        ttft_s=ttft,
        generated=generated,
        extras=extras,
    )


def prompt_drop(round_index: int, new_lengths: bool, earlier: int = 0) -> int:
    """Prompt tokens a timed round leaves off its start: with ``new_lengths`` round ``i``
    (from 0) runs the prompt less its first ``earlier + i + 1``, where ``earlier`` counts the
    timed rounds the process ran before (the scenarios before this one), so no timed run
    repeats a length (and a shape) the warm-up or an earlier round ran
    (``foretell bench --new-lengths``)."""
    return earlier + round_index + 1 if new_lengths else 0


def runtime_info() -> dict[str, Any]:
    """The machine as this process sees it: MLX device and backend, BLAS, versions."""
    from importlib import metadata

    import mlx.core as mx

    from foretell.platform import blas

    if mx.cuda.is_available():
        backend = "cuda"
    elif mx.metal.is_available():
        backend = "metal"
    else:
        backend = "cpu"
    try:
        device_name = mx.device_info().get("device_name")
    except Exception:  # device_info is best-effort across MLX builds
        device_name = None

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "foretell": version("foretell"),
        "backend": backend,
        "device": str(mx.default_device()),
        "device_name": device_name,
        # The BLAS does the CPU's matmuls only: on a GPU its import-order story is noise.
        "blas": (blas.STATUS.describe() if mx.default_device() == mx.cpu
                 else f"not used: the matmuls run on the GPU ({backend})"),
        "blas_status": blas.STATUS.to_dict(),
        "python": platform.python_version(),
    }


def synthetic_model(preset: str, dtype: str, cache_dir: Path = CACHE_DIR, *,
                    bits: int | None = None) -> Path:
    """A random-weight model directory of a named shape (``"30m"`` or
    ``"model_type:30m"``, :func:`foretell.tools.synthetic.make_preset_dir`), made once and reused;
    ``bits`` (4 or 8): its layers stored quantized, as ``mlx_lm.convert -q`` stores them.

    Made in its own process so the weights' memory (GPU memory under CUDA) is not held by
    this one while the sides run; written to a temporary name and renamed, so an
    interrupted run never leaves a half-written model to be reused.
    """
    from foretell.tools.synthetic import presets

    model_type, _, name = preset.rpartition(":")
    quantized = f"-q{bits}" if bits else ""
    path = Path(cache_dir) / f"{model_type or presets()[name]}-{name}-{dtype}{quantized}-seed0"
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    code = (
        "import sys; from foretell.tools.synthetic import make_preset_dir; "
        "make_preset_dir(sys.argv[1], sys.argv[2], dtype=sys.argv[3], "
        "quantize_bits=int(sys.argv[4]) or None)"
    )
    subprocess.run([sys.executable, "-c", code, str(scratch), preset, dtype, str(bits or 0)],
                   check=True)
    try:
        scratch.rename(path)
    except OSError:  # another run finished the same model first
        if not (path / "config.json").is_file():
            raise
    return path


def prompt_ids(model: Path, length: int, seed: int = 0) -> list[int]:
    """Random token ids within the model's vocabulary: the same list goes to both sides.

    :raises BenchError: ``model`` has no readable config.json with a positive vocab_size
        (checked here, before any worker starts, so the error names the file).
    """
    from foretell.errors import BenchError

    file = model / "config.json"
    try:
        vocab = json.loads(file.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as exc:
        reason = "not found" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc})"
        raise BenchError(f"{file}: {reason}; a model directory needs a config.json") from None
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise BenchError(f"{file}: field 'vocab_size' must be a positive integer, got {vocab!r}")
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


#: Two-sided 95% quantiles of Student's t by degrees of freedom (the nearest lower entry is
#: used; beyond 30 the normal 1.96).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


def paired_ratio(
    ours: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]], key: str
) -> float | None:
    """The median of ``ours[i][key] / theirs[i][key]`` over rounds ``i`` whose sides ran
    back to back (a drift between rounds moves both sides of a ratio alike; the ratio of
    the medians mixes rounds); None without a round whose ``theirs`` is above 0."""
    ratios = [a[key] / b[key] for a, b in zip(ours, theirs) if b[key] > 0]
    return statistics.median(ratios) if ratios else None


def paired_ratio_ci(
    ours: Sequence[dict[str, Any]], theirs: Sequence[dict[str, Any]], key: str
) -> list[float] | None:
    """95% confidence interval of foretell/mlx-lm from alternating rounds.

    Round ``i`` of each side ran back to back, so ``ours[i] / theirs[i]`` shares whatever
    the machine was doing then; the interval is Student's t on the logs of those paired
    ratios (geometric, so 2x and 0.5x are symmetric). ``None`` below two rounds.
    """
    logs = [
        math.log(a[key] / b[key]) for a, b in zip(ours, theirs) if a[key] > 0 and b[key] > 0
    ]
    if len(logs) < 2:
        return None
    df = len(logs) - 1
    t = 1.96 if df > 30 else _T95[max(d for d in _T95 if d <= df)]
    mean = statistics.fmean(logs)
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return [math.exp(mean - half), math.exp(mean + half)]


def portable(report: Any) -> Any:
    """``report`` with machine-local paths replaced by placeholders, so a saved report can
    be committed and compared across machines: the foretell package -> ``<site-packages>/
    foretell`` (also from a checkout), site-packages -> ``<site-packages>``, the temporary
    directory -> ``<tmp>``, the home directory -> ``~``."""
    import site
    import sysconfig

    import foretell

    package = Path(foretell.__file__).resolve().parent
    prefixes = [(str(package), "<site-packages>/foretell")]
    for root in {sysconfig.get_paths()["purelib"], *site.getsitepackages()}:
        prefixes.append((str(Path(root).resolve()), "<site-packages>"))
        prefixes.append((str(root), "<site-packages>"))
    prefixes += [(tempfile.gettempdir(), "<tmp>"), (str(Path.home()), "~")]

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            for prefix, placeholder in prefixes:
                value = value.replace(prefix, placeholder)
            return value
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, list):
            return [clean(item) for item in value]
        return value

    return clean(report)


def machine_info() -> dict[str, Any]:
    """What the table was measured on (the MLX side of it comes from the workers)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "gpu": _gpu_name(),
        "os": platform.platform(),
        # Other work on the machine skews every number; the table says how busy it was.
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_name() -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    names = done.stdout.strip().splitlines()
    return ", ".join(names) if done.returncode == 0 and names else None
