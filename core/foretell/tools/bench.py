"""``foretell bench``: foretell against mlx-lm, in one run, on the same weights.

Every speed foretell claims is a ratio against mlx-lm measured this way (DESIGN §5). Each
side runs in its own interpreter, so neither inherits the other's allocator, compiled
kernels or BLAS: mlx-lm runs as it installs by default (``FORETELL_BLAS=reference``, so
importing this module does not put OpenBLAS under it), foretell with its BLAS preload.
Both get the same prompt token ids, generate the same number of tokens (EOS ignored),
do one warm-up run, then ``repeats`` timed runs whose medians are reported. Both sides stay
loaded and their timed runs alternate (A B, B A, ...), so drift on a shared machine hits
both; ``interleave=False`` (``--sequential``) runs one side after the other instead.

A :class:`Scenario` is a name plus how to run it on each side; speculative rows (one per
drafter) and prefix-cache-restore rows are more entries in :data:`SCENARIOS`. A side's
runner is a generator that yields how many tokens each step produced and may return
extras (``{"acceptance": ...}``), which fill the table's optional columns.

    python -m foretell.tools.bench --synthetic 30m,150m --json bench.json
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
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from foretell.platform import cache_home

SIDES = ("foretell", "mlx-lm")
#: On the CPU a third side: mlx-lm on the same OpenBLAS foretell binds, so the table shows
#: the engine's own gain apart from the BLAS's (the mlx-lm row is what users get).
SAME_BLAS = "mlx-lm+openblas"
#: ``--cold-mlx-lm``: the prompt length of the warm-up each fresh mlx-lm process runs before
#: its one timed run. It compiles the kernels, and with prompts longer than it plus the
#: tokens generated its verify windows meet none of the timed run's key lengths.
COLD_WARMUP_TOKENS = 32
#: Default synthetic cache: random weights are made once per (shape, dtype).
CACHE_DIR = cache_home() / "bench"

Steps = Generator[int, None, "dict[str, Any] | None"]
Runner = Callable[[Any, list[int], int], Steps]


@attrs.frozen
class Scenario:
    """One table row: the same request served by each side's runner.

    A runner gets what its side loaded (foretell: an ``Engine``; mlx-lm: ``(model,
    tokenizer)``), the prompt token ids and the number of tokens to generate.
    """

    name: str
    foretell: Runner
    mlx_lm: Runner
    #: Which of the job's prompts it runs on: ``random`` ids, or ``code`` / ``edit`` text.
    prompt: str = "random"
    #: The runners also take the job (draft model, draft length...) as a fourth argument.
    with_job: bool = False


def _foretell_greedy(engine: Any, prompt: list[int], max_tokens: int) -> Steps:
    for event in engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
        if event.type == "text" and event.tokens:
            yield len(event.tokens)
    return None


def _mlx_lm_greedy(loaded: Any, prompt: list[int], max_tokens: int) -> Steps:
    from mlx_lm import stream_generate

    model, tokenizer = loaded
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        yield 1
    return None


def _speculation_scenarios() -> tuple[Scenario, ...]:
    from foretell.spec import bench as spec_bench

    return tuple(
        Scenario(row, foretell=spec_bench.foretell_runner(row),
                 mlx_lm=spec_bench.mlx_lm_runner(row), prompt=prompt, with_job=True)
        for row, prompt in spec_bench.ROWS.items()
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("greedy", foretell=_foretell_greedy, mlx_lm=_mlx_lm_greedy),
    *_speculation_scenarios(),
)
#: ``--speculation`` rows (foretell's drafters against plain decoding and mlx-lm's).
SPECULATION = tuple(s.name for s in SCENARIOS if s.with_job)


# -- one side, in its own process -----------------------------------------------------------


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


def _load_side(side: str, model: str) -> Any:
    if side == "foretell":
        import foretell

        return foretell.load(model)
    from mlx_lm import load

    model_, tokenizer = load(model)
    # Both sides generate exactly max_tokens, whatever random weights say about EOS.
    tokenizer.eos_token_ids = set()
    return model_, tokenizer


def _worker_loop() -> int:
    """One side's process: load the model named on the first stdin line, then time one
    run per request line. Replies are JSON lines on the original stdout; anything a
    library prints goes to stderr, so it can never be mistaken for a reply."""
    from foretell.platform import blas

    blas.preload()  # before mlx is imported; FORETELL_BLAS=reference keeps MLX's own
    import mlx.core as mx

    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    job = json.loads(sys.stdin.readline())
    side = job["side"]
    started = time.perf_counter()
    loaded = _load_side(side, job["model"])
    reply({"load_s": time.perf_counter() - started, "runtime": runtime_info()})
    scenarios = {s.name: s for s in SCENARIOS}
    for line in sys.stdin:
        request = json.loads(line)
        if request["cmd"] == "peak-memory":
            reply({"peak_memory_gb": mx.get_peak_memory() / 1e9})
            mx.reset_peak_memory()
            continue
        scenario = scenarios[request["scenario"]]
        runner = scenario.foretell if side == "foretell" else scenario.mlx_lm
        prompt = _prompt(job, scenario.name)[request.get("drop", 0):]
        extra = (job,) if scenario.with_job else ()
        timing = time_run(runner(loaded, prompt, job["max_tokens"], *extra), len(prompt))
        reply(attrs.asdict(timing))
    return 0


#: A side's process: the BLAS is bound before this module (whose imports may pull in mlx)
#: is imported; FORETELL_BLAS=reference keeps MLX's own.
WORKER = (
    "from foretell.platform import blas; blas.preload(); "
    "from foretell.tools.bench import _worker_loop; raise SystemExit(_worker_loop())"
)


class SideProcess:
    """One side (``"foretell"`` or ``"mlx-lm"``) loaded in its own interpreter, so neither
    inherits the other's allocator, compiled kernels or BLAS, and kept alive so that its
    timed runs can alternate with the other side's."""

    def __init__(self, side: str, job: dict[str, Any], scratch: Path) -> None:
        self.side, self.model = side, job["model"]
        env = dict(os.environ)
        if side == "mlx-lm":
            env["FORETELL_BLAS"] = "reference"  # mlx-lm as it installs: MLX's own BLAS
        self._stderr = open(scratch / f"{side}-stderr.txt", "w+")  # closed by close()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            text=True,
        )
        try:
            loaded = self._ask({**job, "side": side})
        except BaseException:
            self.close()
            raise
        self.load_s, self.runtime = loaded["load_s"], loaded["runtime"]

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._proc.wait()
            self._stderr.seek(0)
            tail = "\n".join(self._stderr.read().strip().splitlines()[-15:])
            raise RuntimeError(f"the {self.side} side failed on {self.model}:\n{tail}")
        return json.loads(line)

    def run(self, scenario: str, drop: int = 0) -> Timing:
        """One timed run of ``scenario``, its prompt less its first ``drop`` tokens."""
        return Timing(**self._ask({"cmd": "run", "scenario": scenario, "drop": drop}))

    def peak_memory_gb(self) -> float:
        """Peak memory since the last call (the first call also clears the warm-up's)."""
        return self._ask({"cmd": "peak-memory"})["peak_memory_gb"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


def _summary(runs: list[Timing], peak_memory_gb: float) -> dict[str, Any]:
    return {
        "runs": [attrs.asdict(r) for r in runs],
        "prefill_tps": statistics.median(r.prefill_tps for r in runs),
        "decode_tps": statistics.median(r.decode_tps for r in runs),
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "generated": runs[0].generated,
        "extras": runs[-1].extras,
        "peak_memory_gb": peak_memory_gb,
    }


def prompt_drop(round_index: int, new_lengths: bool, earlier: int = 0) -> int:
    """Prompt tokens a timed round leaves off its start: with ``new_lengths`` round ``i``
    (from 0) runs the prompt less its first ``earlier + i + 1``, where ``earlier`` counts the
    timed rounds the process ran before (the scenarios before this one), so no timed run
    repeats a length (and a shape) the warm-up or an earlier round ran (see :func:`_measure`)."""
    return earlier + round_index + 1 if new_lengths else 0


def _measure(
    sides: dict[str, SideProcess],
    scenario: str,
    repeats: int,
    progress: Callable[[str], None] = lambda _: None,
    new_lengths: bool = False,
    earlier: int = 0,
    paired_plain: str | None = None,
    fresh: dict[str, Callable[[], SideProcess]] | None = None,
    warm_drop: int = 0,
    warmed: set[str] | None = None,
) -> dict[str, dict[str, Any]]:
    """A warm-up run per side, then ``repeats`` rounds in which each side runs once, the
    order flipping every round (A B, B A, ...), so a slow spell on a shared machine lands
    on both sides rather than on whichever ran during it.

    ``paired_plain`` (a speculation row's plain row): in every round foretell also runs that
    row on the same prompt right beside its timed run (before it in even rounds, after it
    in odd ones), so the speculation row's ratio to plain decoding pairs runs the host ran
    back to back (``plain_runs`` in foretell's summary). A ratio between rows run minutes
    apart is as noisy as the host: on the H200 the same MTP row measured 1.15x and 1.43x
    row against row, 1.49x as a paired median (docs/benchmarks.md).

    ``fresh`` (side -> a factory of its process): that side runs every timed run in a process
    of its own, warmed up first by one run of the prompt less its first ``warm_drop`` tokens
    (a short prompt), and closed after; its long-lived process in ``sides`` sits the scenario
    out. So none of its verify windows meets a kernel plan an earlier run of the bench left,
    which is what a user's first request to mlx-lm meets (``--cold-mlx-lm``).

    ``warmed``: the rows foretell's process has already had a warm-up run of, shared by the
    scenarios of one run (a paired plain row is warmed up once, not before every speculation
    row it pairs with); this scenario's are added to it.

    ``new_lengths``: round ``i`` runs the prompt less its first ``earlier + i + 1`` tokens
    (the warm-up the whole prompt), the same on both sides; ``earlier`` is the number of
    timed rounds the same processes ran for earlier scenarios, so no timed run repeats a
    prompt length, and no shape, the process has run. A GPU plans its kernels per shape
    and keeps the plans: a run that repeats an earlier run's prompt length gets its plans
    for free (mlx-lm's speculative verify windows, each a new key length, and any prefill),
    which no user's new prompt does. Until 2026-12-02 the count restarted with each
    scenario, so a later row's round ``i`` met the lengths of every earlier row's round
    ``i`` (mlx-lm's self-drafting row ran 694 tok/s in one round, 43-51 in the others)."""
    fresh = fresh or {}
    warmed = set() if warmed is None else warmed
    runs: dict[str, list[Timing]] = {side: [] for side in sides}
    peaks: dict[str, float] = {}
    plain: list[Timing] = []
    for side, proc in sides.items():
        if side in fresh:
            continue
        if side == "foretell" and paired_plain and paired_plain not in warmed:
            proc.run(paired_plain)
        proc.run(scenario)
        proc.peak_memory_gb()
    warmed.update(r for r in (scenario, paired_plain) if r)
    order = list(sides)
    for i in range(repeats):
        drop = prompt_drop(i, new_lengths, earlier)
        for side in order if i % 2 == 0 else order[::-1]:
            if side == "foretell" and paired_plain and i % 2 == 0:
                plain.append(sides[side].run(paired_plain, drop))
            if side in fresh:
                timing, peaks[side] = _cold_run(fresh[side], scenario, drop, warm_drop)
                runs[side].append(timing)
            else:
                runs[side].append(sides[side].run(scenario, drop))
            if side == "foretell" and paired_plain and i % 2 == 1:
                plain.append(sides[side].run(paired_plain, drop))
        speeds = ", ".join(f"{side} {runs[side][-1].decode_tps:.1f}" for side in order)
        if plain:
            speeds += f" (foretell {paired_plain} {plain[-1].decode_tps:.1f})"
        progress(f"  {scenario} round {i + 1}/{repeats}: decode tok/s {speeds}")
    summary = {side: _summary(runs[side], peaks[side] if side in fresh
                              else sides[side].peak_memory_gb()) for side in sides}
    if plain:
        summary["foretell"]["plain_runs"] = [attrs.asdict(r) for r in plain]
    return summary


def _cold_run(make: Callable[[], SideProcess], scenario: str, drop: int, warm_drop: int
              ) -> tuple[Timing, float]:
    """One timed run in a new process of its own, after one warm-up run on a short prompt;
    with the timed run's peak memory."""
    proc = make()
    try:
        proc.run(scenario, warm_drop)
        proc.peak_memory_gb()
        return proc.run(scenario, drop), proc.peak_memory_gb()
    finally:
        proc.close()


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


# -- the whole comparison -------------------------------------------------------------------


def synthetic_model(preset: str, dtype: str, cache_dir: Path = CACHE_DIR) -> Path:
    """A random-weight model directory of a named shape (``"30m"`` or
    ``"model_type:30m"``, :func:`foretell.tools.synthetic.make_preset_dir`), made once and reused.

    Made in its own process so the weights' memory (GPU memory under CUDA) is not held by
    this one while the sides run; written to a temporary name and renamed, so an
    interrupted run never leaves a half-written model to be reused.
    """
    from foretell.tools.synthetic import presets

    model_type, _, name = preset.rpartition(":")
    path = Path(cache_dir) / f"{model_type or presets()[name]}-{name}-{dtype}-seed0"
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    code = (
        "import sys; from foretell.tools.synthetic import make_preset_dir; "
        "make_preset_dir(sys.argv[1], sys.argv[2], dtype=sys.argv[3])"
    )
    subprocess.run([sys.executable, "-c", code, str(scratch), preset, dtype], check=True)
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


def _wants_same_blas(runtime: dict[str, Any]) -> bool:
    return runtime["backend"] == "cpu" and bool(runtime["blas_status"]["loaded"])


def compare(
    model: Path,
    *,
    label: str,
    prompt_tokens: int,
    max_tokens: int,
    repeats: int,
    scenarios: Sequence[str] = ("greedy",),
    interleave: bool = True,
    progress: Callable[[str], None] = lambda _: None,
    draft: dict[str, Any] | None = None,
    new_lengths: bool = False,
    cold_mlx_lm: bool = False,
) -> dict[str, Any]:
    """Both sides on one model: per scenario, each side's medians and foretell/mlx-lm.

    ``cold_mlx_lm``: the rows where mlx-lm speculates run each of its timed runs in a fresh
    process warmed up on a :data:`COLD_WARMUP_TOKENS`-token prompt (see :func:`_measure`).

    ``draft`` (``{"draft_model": ..., "num_draft_tokens": ...}``) feeds the speculation rows.

    ``interleave`` keeps both sides loaded and alternates their timed runs; without it
    each side runs all of its repeats alone (one model copy in memory at a time). When
    foretell runs on the CPU with OpenBLAS, mlx-lm also runs on that OpenBLAS
    (:data:`SAME_BLAS`) and each scenario gets a second row against it.
    """
    job = {"model": str(model), "prompt": prompt_ids(model, prompt_tokens),
           "max_tokens": max_tokens, **(draft or {})}
    if any(name in SPECULATION for name in scenarios):
        from foretell.spec.bench import code_prompts, runnable
        from foretell.tokenizer import Tokenizer

        job["prompts"] = code_prompts(Tokenizer.from_dir(model), prompt_tokens)
        kept = runnable(model, scenarios, job.get("draft_model"))
        for name in sorted(set(scenarios) - set(kept)):
            progress(f"  {label}: skipping {name} (this model cannot run it)")
        scenarios = kept
    measured: dict[str, dict[str, Any]] = {name: {} for name in scenarios}
    procs: dict[str, SideProcess] = {}
    with tempfile.TemporaryDirectory(prefix="foretell-bench-") as scratch:
        groups = [list(SIDES)] if interleave else [[side] for side in SIDES]
        for group in groups:
            running: dict[str, SideProcess] = {}
            try:
                for side in group:  # may grow by SAME_BLAS once foretell reports its BLAS
                    running[side] = procs[side] = SideProcess(side, job, Path(scratch))
                    if side == "foretell" and _wants_same_blas(procs[side].runtime):
                        (group if interleave else groups).append(
                            SAME_BLAS if interleave else [SAME_BLAS]
                        )
                warmed: set[str] = set()
                for earlier, name in enumerate(scenarios):
                    fresh, warm_drop = {}, 0
                    if cold_mlx_lm and _mlx_lm_speculates(name):
                        cold = Path(scratch) / "cold"  # stderr files apart from the long-lived
                        cold.mkdir(exist_ok=True)
                        fresh = {side: partial(SideProcess, side, job, cold)
                                 for side in running if side != "foretell"}
                        warm_drop = max(len(_prompt(job, name)) - COLD_WARMUP_TOKENS, 0)
                    measured[name].update(_measure(running, name, repeats, progress,
                                                   new_lengths=new_lengths,
                                                   earlier=earlier * repeats,
                                                   paired_plain=_paired_plain(name),
                                                   fresh=fresh, warm_drop=warm_drop,
                                                   warmed=warmed))
            finally:
                for proc in running.values():
                    proc.close()
    rows = []
    baselines = [b for b in ("mlx-lm", SAME_BLAS) if b in procs]
    for name, baseline in ((n, b) for n in scenarios for b in baselines):
        ours, theirs = measured[name]["foretell"], measured[name][baseline]
        rows.append(
            {
                "scenario": name,
                # mlx-lm as it installs, or on foretell's OpenBLAS (the engine's own gain)
                "baseline": baseline,
                "foretell": ours,
                "mlx_lm": theirs,
                "prefill_ratio": _ratio(ours["prefill_tps"], theirs["prefill_tps"]),
                "decode_ratio": _ratio(ours["decode_tps"], theirs["decode_tps"]),
                # Rounds pair up only when the sides alternated.
                "decode_ratio_ci95": (
                    paired_ratio_ci(ours["runs"], theirs["runs"], "decode_tps")
                    if interleave
                    else None
                ),
                "acceptance": ours["extras"].get("acceptance"),
                "tokens_per_forward": ours["extras"].get("tokens_per_forward"),
                "mlx_lm_from_draft": theirs["extras"].get("from_draft"),
                # Against plain foretell on the same prompt, in this run: row against row,
                # and the median of each round's run against the plain run beside it.
                "vs_plain": _vs_plain(measured, name),
                "vs_plain_paired": _vs_plain_paired(ours),
            }
        )
    return {
        "model": label,
        "path": str(model),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": max_tokens,
        "repeats": repeats,
        "interleaved": interleave,
        "new_lengths": new_lengths,
        "cold_mlx_lm": cold_mlx_lm,
        "load_s": {side: proc.load_s for side, proc in procs.items()},
        "runtime": {side: proc.runtime for side, proc in procs.items()},
        "rows": rows,
    }


#: Two-sided 95% quantiles of Student's t by degrees of freedom (the nearest lower entry is
#: used; beyond 30 the normal 1.96).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04}


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


def _mlx_lm_speculates(name: str) -> bool:
    from foretell.spec.bench import mlx_lm_drafts

    return name in SPECULATION and mlx_lm_drafts(name)


def _prompt(job: dict[str, Any], name: str) -> list[int]:
    """The prompt ids a scenario runs on (as the worker picks them)."""
    prompt = {s.name: s.prompt for s in SCENARIOS}[name]
    return job["prompts"][prompt] if prompt != "random" else job["prompt"]


def _paired_plain(name: str) -> str | None:
    """The plain row a speculation row's rounds pair with, or None (not a speculation row,
    or a plain row itself)."""
    from foretell.spec.bench import plain_row

    plain = plain_row(name)
    return plain if name in SPECULATION and plain != name else None


def _vs_plain_paired(ours: dict[str, Any]) -> float | None:
    pairs = zip(ours["runs"], ours.get("plain_runs", []))
    ratios = [a["decode_tps"] / b["decode_tps"] for a, b in pairs if b["decode_tps"] > 0]
    return statistics.median(ratios) if ratios else None


def _vs_plain(measured: dict[str, dict[str, Any]], name: str) -> float | None:
    from foretell.spec.bench import plain_row

    plain = plain_row(name)
    if name not in SPECULATION or plain not in measured or name == plain:
        return None
    return _ratio(measured[name]["foretell"]["decode_tps"],
                  measured[plain]["foretell"]["decode_tps"])


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


def _ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs > 0 else None


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


def run_bench(
    models: Sequence[tuple[str, Path]],
    *,
    prompt_tokens: int,
    max_tokens: int,
    repeats: int,
    interleave: bool = True,
    progress: Callable[[str], None] = lambda _: None,
    on_model: Callable[[dict[str, Any]], None] = lambda _: None,
    scenarios: Sequence[str] = ("greedy",),
    draft: dict[str, Any] | None = None,
    new_lengths: bool = False,
    cold_mlx_lm: bool = False,
) -> dict[str, Any]:
    """Compare every model (``new_lengths``: see :func:`_measure`); ``on_model`` sees the
    report after each one (to save partial results before a time limit cuts the run
    short)."""
    report: dict[str, Any] = {"machine": machine_info(), "models": []}
    for label, path in models:
        how = "alternating" if interleave else "one side after the other"
        progress(f"{label}: foretell and mlx-lm, {repeats} repeat(s) after a warm-up, {how}")
        report["models"].append(
            compare(
                path,
                label=label,
                prompt_tokens=prompt_tokens,
                max_tokens=max_tokens,
                repeats=repeats,
                interleave=interleave,
                progress=progress,
                scenarios=scenarios,
                draft=draft,
                new_lengths=new_lengths,
                cold_mlx_lm=cold_mlx_lm,
            )
        )
        on_model(report)
    return report


def render(report: dict[str, Any]) -> str:
    """The report as a plain-text table with the machine above it."""
    machine = report["machine"]
    lines = [
        f"date     {machine['date']}",
        f"machine  {machine['cpu']} ({machine['cores']} cores)"
        + (f", GPU {machine['gpu']}" if machine["gpu"] else ""),
        f"os       {machine['os']}, load average {machine['load_avg_1m']} at start",
    ]
    if report["models"]:
        runtime = report["models"][0]["runtime"]
        ours, theirs = runtime["foretell"], runtime["mlx-lm"]
        lines += [
            f"mlx      {ours['mlx']} ({ours['backend']}, {ours['device']}"
            + (f", {ours['device_name']}" if ours["device_name"] else "")
            + f"), mlx-lm {theirs['mlx_lm']}, foretell {ours['foretell']}, "
            f"python {ours['python']}",
            f"BLAS     foretell: {ours['blas']}",
            f"         mlx-lm:   {theirs['blas']}",
        ]
        if SAME_BLAS in runtime:
            lines.append(f"         {SAME_BLAS}: {runtime[SAME_BLAS]['blas']}")
    header = (
        f"{'model':<10} {'scenario':<20} {'mlx-lm on':<10} {'prompt':>6} {'gen':>5} "
        f"{'prefill tok/s':>27} {'decode tok/s':>27} {'decode ratio':>13} {'accept':>7}"
        f" {'tok/fwd':>7} {'vs plain':>8}"
    )
    sub = (
        f"{'':<10} {'':<20} {'':<10} {'':>6} {'':>5} "
        + f"{'foretell  mlx-lm   ratio':>27} " * 2
        + f"{'95% CI':>13}"
    )
    lines += ["", header, sub.rstrip()]
    for model in report["models"]:
        for row in model["rows"]:
            accept = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else ""
            per_forward = row.get("tokens_per_forward")
            per_forward = f"{per_forward:.2f}" if per_forward is not None else ""
            # The paired median where the rounds ran a plain run beside each timed one.
            shown = row.get("vs_plain_paired") or row.get("vs_plain")
            vs_plain = f"{shown:.2f}x" if shown is not None else ""
            ci = row.get("decode_ratio_ci95")
            shown_ci = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
            blas = "OpenBLAS" if row.get("baseline") == SAME_BLAS else "its BLAS"
            lines.append(
                f"{model['model']:<10} {row['scenario']:<20} {blas:<10} {model['prompt_tokens']:>6} "
                f"{model['generated_tokens']:>5} "
                f"{_cell(row, 'prefill')} {_cell(row, 'decode')} {shown_ci:>13} {accept:>7}"
                f" {per_forward:>7} {vs_plain:>8}"
            )
    return "\n".join(lines)


def _cell(row: dict[str, Any], what: str) -> str:
    ratio = row[f"{what}_ratio"]
    shown = f"{ratio:.2f}x" if ratio is not None else "-"
    return (
        f"{row['foretell'][f'{what}_tps']:>9.1f} {row['mlx_lm'][f'{what}_tps']:>8.1f} "
        f"{shown:>8}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker_loop()
    from foretell.cli import main as cli_main

    return cli_main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
