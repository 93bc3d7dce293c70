"""The cache benchmark (``foretell bench --cache``): what the prefix cache buys and costs.

For each model, in one run, over one storage layout (the tier's default, ``blocks``, unless
``--layout`` names another):

- time to first token for a long prompt (default 4,096 tokens): cold prefill (on a GPU also
  at prompt lengths the process has not run: kernels are planned per shape), a RAM hit,
  and an SSD restore in a fresh process, with the page cache warm and with the entry's
  pages evicted (``posix_fadvise(DONTNEED)``, no root needed);
- restore bandwidth beside ``dd``'s sequential read of the same bytes (the entry's files:
  one for ``single-file``; a manifest and its blocks for ``blocks``);
- mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` on the same prompt's KV;
- verified vs unverified reads of the entry (every checksum vs none), taking turns in one
  process;
- decode tok/s with nothing else running vs while a background thread keeps writing the
  entry, as the spill worker would (the ratio: the median of each writing round over the
  idle round beside it); and within one long decode, the steps a write ran through against
  those no write touched, the worker resting as long as each write took.

Each phase runs in its own process (:mod:`foretell.tools.bench_cache_phases`), so "fresh
process" means it. Not a test: numbers only, never assertions.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from foretell.config import DEFAULT_LAYOUT
from foretell.store.reserve import ENV as RESERVE_ENV
from foretell.tools.bench_cache_phases import evict, layout_contribution
from foretell.tools.measure import machine_info, median, prompt_ids, runtime_info

#: GNU dd reports "... copied, 0.0123 s, 4.1 GB/s"; BSD dd "... transferred in 0.0123 secs".
_DD_SECONDS = re.compile(r"([0-9.]+(?:e-?[0-9]+)?) s(?:ecs?|econds?)?\b")
#: dd's block size. 1 MiB, not 16: a 16 MiB buffer outgrows the CPU's cache and its first
#: touch page-faults, so dd would measure itself.
DD_BLOCK = "1M"


def dd_read(paths: Sequence[Path], *, cold: bool) -> dict[str, float]:
    """``dd``'s sequential read (1 MiB blocks, to /dev/null) of the files, one ``dd`` per
    file in read order, timed by what each ``dd`` reports (its copy loop, not its start-up),
    summed: the bytes a restore reads, read by the plainest reader. ``cold``: every file's
    pages evicted first."""
    if cold:
        evict(paths)
    seconds = wall = 0.0
    for path in paths:
        start = time.perf_counter()
        done = subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}"],
                              check=True, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
        reported = _DD_SECONDS.findall(done.stderr)
        seconds += float(reported[-1]) if reported else elapsed
        wall += elapsed
    size = sum(p.stat().st_size for p in paths)
    return {"seconds": seconds, "wall_seconds": wall, "gb_per_s": size / seconds / 1e9,
            "files": len(paths), "bytes": size}


def _run_phase(phase: str, model: Path, directory: Path, prompt_file: Path, *extra: str,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "foretell.tools.bench_cache_phases", phase, "--model", str(model),
         "--dir", str(directory), "--prompt", str(prompt_file), *extra],
        capture_output=True, text=True, env={**os.environ, **(env or {})})
    for line in done.stdout.splitlines():
        if line.startswith("FORETELL-CACHE-BENCH "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"cache bench phase '{phase}' failed (exit {done.returncode}):\n"
                       f"{done.stderr[-3000:]}")


# -- the whole run ----------------------------------------------------------------------------


def run_cache_bench(models: Sequence[tuple[str, Path]], *, prompt_tokens: int, repeats: int,
                    decode_tokens: int, layout: str | None = None, work_dir: Path | None = None,
                    reserve_ab: bool = False, kv_bits: int | None = None,
                    progress: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Every phase for each model over the storage layout ``layout`` (a registered name;
    default: the tier's default layout). ``reserve_ab``: every fresh-process restore also
    runs with the restore reserve off (``FORETELL_RESTORE_RESERVE_MB=0``), taking turns
    with the default (``restore_*_no_reserve``). ``kv_bits``: every phase runs the model with
    its KV quantized to that many bits (``--kv-bits``), so the entry holds the quantized KV a
    user running with it stores, and the cold prefill is that user's too."""
    layout = layout or DEFAULT_LAYOUT
    layout_contribution(layout)  # an unknown name fails here, before any model loads
    rows = []
    for name, model in models:
        scratch = Path(tempfile.mkdtemp(prefix="foretell-cache-bench-", dir=work_dir))
        try:
            directory = scratch / "cache"
            prompt_file = scratch / "prompt.json"
            prompt_file.write_text(json.dumps(prompt_ids(model, prompt_tokens)))
            common = ["--repeats", str(repeats), "--decode-tokens", str(decode_tokens),
                      "--layout", layout, *(["--kv-bits", str(kv_bits)] if kv_bits else [])]
            progress(f"{name} ({layout}): cold prefill, RAM hits, store, reads, mlx-lm files, "
                     "decode")
            row: dict[str, Any] = {"model": name, "layout": layout, "prompt_tokens": prompt_tokens,
                                   "kv_bits": kv_bits}
            row["prime"] = _run_phase("prime", model, directory, prompt_file, *common)
            progress(f"{name}: SSD restore in fresh processes (page cache warm, then evicted)")
            variants = [("", None)] + ([("_no_reserve", {RESERVE_ENV: "0"})] if reserve_ab else [])
            runs: dict[str, list[dict[str, Any]]] = {}
            for turn in range(repeats):  # alternating, each in a fresh process
                order = variants if turn % 2 == 0 else variants[::-1]
                for kind, flags in (("warm", ()), ("evicted", ("--evict",))):
                    for suffix, env in order:
                        runs.setdefault(kind + suffix, []).append(_run_phase(
                            "restore", model, directory, prompt_file, *common, *flags, env=env))
            for kind, found in runs.items():
                row["restore_" + kind] = _median_run(found)
            paths = [Path(p) for p in row["prime"]["entry_files"]]
            row.update(_dd_rows(paths, scratch / "one-file", repeats))
            rows.append(row)
            progress(render_row(row))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return {"machine": machine_info(), "runtime": runtime_info(), "layout": layout,
            "rows": rows}


def _dd_rows(paths: list[Path], one_file: Path, repeats: int) -> dict[str, Any]:
    """``dd`` over the entry's own files (what the restore reads), warm and evicted; for an
    entry of several files, also over one file of the same bytes (the disk's sequential
    figure, what a single-file entry would get), taking turns with the first."""
    readers = {"": paths}
    if len(paths) > 1:
        with open(one_file, "wb") as out:
            for path in paths:
                out.write(path.read_bytes())
            out.flush()
            os.fsync(out.fileno())
        readers["_one_file"] = [one_file]
    rows: dict[str, Any] = {}
    for kind, cold in (("dd_warm", False), ("dd_evicted", True)):
        runs: dict[str, list[dict[str, float]]] = {suffix: [] for suffix in readers}
        for _ in range(repeats):
            for suffix, files in readers.items():
                runs[suffix].append(dd_read(files, cold=cold))
        for suffix, reads in runs.items():
            rows[kind + suffix] = {"seconds": median([r["seconds"] for r in reads]),
                                   "gb_per_s": median([r["gb_per_s"] for r in reads]),
                                   "files": reads[0]["files"], "block": DD_BLOCK, "runs": reads}
    return rows


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field medians of several restore runs, with the runs kept beside them."""
    numeric = [k for k, v in runs[0].items() if isinstance(v, float)]
    summary = dict(runs[0])
    summary.update({k: median([r[k] for r in runs if r[k] is not None]) for k in numeric})
    summary["runs"] = runs
    return summary


def render_row(row: dict[str, Any]) -> str:
    p, rw, re_ = row["prime"], row["restore_warm"], row["restore_evicted"]
    return (f"{_model_cell(row)} ({row['layout']}): cold {p['cold_ttft_s']:.3f}s, RAM hit {p['ram_hit_ttft_s']:.4f}s, "
            f"SSD {rw['ttft_s']:.4f}s warm / {re_['ttft_s']:.4f}s evicted")


def render(report: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md carries."""
    m = report["machine"]
    lines = [
        f"{m['date']} · {m['cpu']} ({m['cores']} cores){' · ' + m['gpu'] if m['gpu'] else ''}"
        f" · load {m['load_avg_1m']} · MLX {report['runtime']['mlx']} "
        f"({report['runtime']['backend']})",
        "",
        "| model | layout | prompt | cold TTFT | RAM hit TTFT | SSD restore TTFT (warm / evicted) "
        "| cold / SSD (warm / evicted) | restore read GB/s (warm / evicted) | dd GB/s, the entry's files (warm / "
        "evicted) | restore / dd | dd GB/s, one file of its bytes | verified / unverified read "
        "| mlx-lm save / load (warm / evicted) | decode tok/s idle / writing (paired ratio; "
        "steps within one decode) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        p, rw, re_ = row["prime"], row["restore_warm"], row["restore_evicted"]
        lm = p.get("mlx_lm") or {}
        lm_cell = (f"{lm['save_s']:.3f} / {lm['load_warm_s']:.3f} / {lm['load_evicted_s']:.3f} s"
                   if "save_s" in lm else lm.get("skipped", "n/a"))
        d, reads = p["decode"], p["reads"]
        reads_cell = (f"{reads['ratio']:.2f}× ({reads['verified_s'] * 1e3:.1f} / "
                      f"{reads['unverified_s'] * 1e3:.1f} ms, {reads['checksum']})"
                      if "ratio" in reads else reads.get("skipped", "n/a"))
        dw, de = row["dd_warm"], row["dd_evicted"]
        ow, oe = row.get("dd_warm_one_file", dw), row.get("dd_evicted_one_file", de)
        one_cell = (f"{ow['gb_per_s']:.2f} / {oe['gb_per_s']:.2f}" if "dd_warm_one_file" in row
                    else "(the same)")
        lines.append(
            f"| {_model_cell(row)} | {row.get('layout', 'single-file')} "
            f"| {row['prompt_tokens']} ({p['entry_bytes'] / 1e6:.1f} MB"
            f"{', ' + str(dw['files']) + ' files' if dw.get('files', 1) > 1 else ''}) "
            f"| {p['cold_ttft_s']:.3f} s{_new_length_cell(p)} | {p['ram_hit_ttft_s'] * 1e3:.1f} ms "
            f"| {rw['ttft_s'] * 1e3:.1f} / {re_['ttft_s'] * 1e3:.1f} ms "
            f"| **{_times(p['cold_ttft_s'] / rw['ttft_s'])} / "
            f"{_times(p['cold_ttft_s'] / re_['ttft_s'])}** "
            f"| {rw['read_gb_per_s']:.2f} / {re_['read_gb_per_s']:.2f} "
            f"| {dw['gb_per_s']:.2f} / {de['gb_per_s']:.2f} "
            f"| {rw['read_gb_per_s'] / dw['gb_per_s']:.0%} / "
            f"{re_['read_gb_per_s'] / de['gb_per_s']:.0%} "
            f"| {one_cell} | {reads_cell} | {lm_cell} "
            f"| {d['idle_tps']:.1f} / {d['writing_tps']:.1f} ({d['ratio']:.2f}×){_interleaved_cell(d)} |")
    if any("restore_warm_no_reserve" in row for row in report["rows"]):
        lines += ["", *render_reserve_ab(report["rows"])]
    return "\n".join(lines)


def _interleaved_cell(decode: dict[str, Any]) -> str:
    found = decode.get("interleaved")
    if not found:
        return ""
    cell = (f"; in one decode {found['ratio']:.2f}× ({found['writing_steps']} steps "
            f"writing, {found['idle_steps']} idle)")
    for phase, label in (("removing", "deleting"), ("edge", "at a write's ends")):
        if found.get(f"{phase}_steps"):
            cell += (f", {label} {found[f'{phase}_ratio']:.2f}× ({found[f'{phase}_steps']}"
                     f"; slowest {found[f'{phase}_slowest_s'] * 1e3:.0f} ms)")
    return cell


def _times(ratio: float) -> str:
    """A speed-up as the table shows it: whole numbers from 10×, two decimals below (on a
    GPU a restore may take about as long as the prefill: 0.24×, not 0×)."""
    return f"{ratio:.0f}×" if ratio >= 10 else f"{ratio:.2f}×"


def _model_cell(row: dict[str, Any]) -> str:
    bits = row.get("kv_bits")
    return f"{row['model']}, KV {bits}-bit" if bits else row["model"]


def _new_length_cell(prime: dict[str, Any]) -> str:
    new = prime.get("cold_new_length_ttft_s")
    return f" ({new:.3f} s at a new length)" if new is not None else ""


def render_reserve_ab(rows: list[dict[str, Any]]) -> list[str]:
    """The restore with the reserve (the default) and without, from ``reserve_ab`` runs."""
    lines = ["| model | restore reserve | SSD restore TTFT (warm / evicted) | restore read ms "
             "(warm / evicted) | restore / dd (warm / evicted) | fill at the tier's opening "
             "| tier opening (scan + fill) |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if "restore_warm_no_reserve" not in row:
            continue
        dw, de = row["dd_warm"], row["dd_evicted"]
        for label, suffix in (("on", ""), ("off", "_no_reserve")):
            rw, re_ = row["restore_warm" + suffix], row["restore_evicted" + suffix]
            served = sum(r["reserve_served"] for r in rw["runs"] + re_["runs"])
            lines.append(
                f"| {row['model']} | {label} ({served} of {len(rw['runs']) + len(re_['runs'])}"
                f" restores served) | {rw['ttft_s'] * 1e3:.1f} / {re_['ttft_s'] * 1e3:.1f} ms "
                f"| {rw['read_s'] * 1e3:.1f} / {re_['read_s'] * 1e3:.1f} "
                f"| {rw['read_gb_per_s'] / dw['gb_per_s']:.0%} / "
                f"{re_['read_gb_per_s'] / de['gb_per_s']:.0%} "
                f"| {rw['reserve_open_fill_s'] * 1e3:.1f} ms | {rw['scan_s'] * 1e3:.1f} ms |")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from foretell.cli import main as cli_main

    return cli_main(["bench", "--cache", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
