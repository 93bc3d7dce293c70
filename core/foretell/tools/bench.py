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

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs

from foretell.tools.measure import (
    Steps,
    Timing,
    machine_info,
    paired_ratio,
    paired_ratio_ci,
    prompt_drop,
    prompt_ids,
    runtime_info,
    time_run,
)

SIDES = ("foretell", "mlx-lm")
#: On the CPU a third side: mlx-lm on the same OpenBLAS foretell binds, so the table shows
#: the engine's own gain apart from the BLAS's (the mlx-lm row is what users get).
SAME_BLAS = "mlx-lm+openblas"
#: ``--cold-mlx-lm``: the prompt length of the warm-up each fresh mlx-lm process runs before
#: its one timed run. It compiles the kernels, and with prompts longer than it plus the
#: tokens generated its verify windows meet none of the timed run's key lengths.
COLD_WARMUP_TOKENS = 32
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
    from foretell.tools import bench_spec as spec_bench

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

    ``paired_plain``: foretell also runs this plain row right beside each timed run, so a
    speculation row's ratio to plain decoding pairs runs made back to back (``plain_runs``).
    ``fresh`` (side -> a factory of its process): that side runs each timed run in a new
    process warmed up on the prompt less ``warm_drop`` tokens, so it meets no kernel plan an
    earlier run left (``--cold-mlx-lm``). ``warmed``: rows foretell has warmed up already
    (shared across one run's scenarios). ``new_lengths``: round ``i`` runs the prompt less
    its first ``earlier + i + 1`` tokens on both sides, so no timed run repeats a shape the
    process planned kernels for (a GPU keeps its plans per shape)."""
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


# -- the whole comparison -------------------------------------------------------------------


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
        from foretell.tokenizer import Tokenizer
        from foretell.tools.bench_spec import code_prompts, runnable

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


def _mlx_lm_speculates(name: str) -> bool:
    from foretell.tools.bench_spec import mlx_lm_drafts

    return name in SPECULATION and mlx_lm_drafts(name)


def _prompt(job: dict[str, Any], name: str) -> list[int]:
    """The prompt ids a scenario runs on (as the worker picks them)."""
    prompt = {s.name: s.prompt for s in SCENARIOS}[name]
    return job["prompts"][prompt] if prompt != "random" else job["prompt"]


def _paired_plain(name: str) -> str | None:
    """The plain row a speculation row's rounds pair with, or None (not a speculation row,
    or a plain row itself)."""
    from foretell.tools.bench_spec import plain_row

    plain = plain_row(name)
    return plain if name in SPECULATION and plain != name else None


def _ratio(ours: float, theirs: float) -> float | None:
    return ours / theirs if theirs > 0 else None


def _vs_plain_paired(ours: dict[str, Any]) -> float | None:
    return paired_ratio(ours["runs"], ours.get("plain_runs", []), "decode_tps")


def _vs_plain(measured: dict[str, dict[str, Any]], name: str) -> float | None:
    from foretell.tools.bench_spec import plain_row

    plain = plain_row(name)
    if name not in SPECULATION or plain not in measured or name == plain:
        return None
    return _ratio(measured[name]["foretell"]["decode_tps"],
                  measured[plain]["foretell"]["decode_tps"])


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
