"""foretell's speculation rows alone, each round pairing every row with plain decoding.

    python benchmarks/spec_paired.py [--model demo] [--row ROW ...] [--new-lengths]
                                     [--fixed-shapes-ab] [--repeats 5] [--json FILE]

The rows are ``foretell bench --speculation``'s (:mod:`foretell.tools.bench_spec`), in one
process and without mlx-lm, so it runs more rounds in the same time: each round runs every
row once, the order flipping per round, and a row's ``vs_plain_paired_median`` is the median
of its ratios to the plain run of the same round. Numbers only, never assertions.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from typing import Any

from foretell.platform import blas
from foretell.tools import bench_spec
from foretell.tools.measure import machine_info, portable, prompt_drop, runtime_info, time_run


def foretell_only(model: str, rows: list[str], *, prompt_tokens: int, max_tokens: int,
                  repeats: int, draft_model: str, num_draft_tokens: int,
                  ngram_draft_tokens: int | None = None, draft_vocab: int | None = None,
                  mtp_tokens: int | None = None, adaptive: bool = True,
                  fixed_shapes_ab: bool = False,
                  new_lengths: bool = False, progress=lambda _line: None) -> dict[str, Any]:
    """foretell's rows in one process, each round running every row once (order flipping
    per round), so drift lands on all of them; ratios are against ``plain`` on the same
    prompt. mlx-lm is not involved (``foretell bench --speculation`` adds it). ``adaptive``
    False drafts every row's most tokens each round (what a round costs, drafting forced).
    ``fixed_shapes_ab`` runs every row twice per round, as ``ROW@fixed-on`` and
    ``ROW@fixed-off`` (:mod:`foretell.model.fixed` forced either way), each against the plain
    row of its own mode. ``new_lengths``: every row of a round runs its prompt less the
    first tokens :func:`foretell.tools.measure.prompt_drop` says (the warm-up: the whole
    prompt), so no timed run repeats the shapes an earlier one traced or planned."""
    from foretell.engine import load, resolve_model_path
    from foretell.model import fixed

    engine = load(model)
    path = resolve_model_path(model)
    job = {"model": str(path), "draft_model": str(resolve_model_path(draft_model)),
           "num_draft_tokens": num_draft_tokens, "ngram_draft_tokens": ngram_draft_tokens,
           "mtp_draft_vocab": draft_vocab, "mtp_draft_tokens": mtp_tokens,
           "adaptive": adaptive}
    prompts = bench_spec.code_prompts(engine.tokenizer, prompt_tokens)
    rows = bench_spec.runnable(path, rows, job["draft_model"])
    if fixed_shapes_ab:
        rows = [f"{row}@fixed-{mode}" for row in rows for mode in ("on", "off")]
    runs: dict[str, list[Any]] = {row: [] for row in rows}

    def once(name: str, drop: int = 0):
        row, _, mode = name.partition("@fixed-")
        prompt = prompts[bench_spec.ROWS[row]][drop:]
        with fixed.forced(mode) if mode else contextlib.nullcontext():
            steps = bench_spec.foretell_runner(row)(engine, prompt, max_tokens, job)
            return time_run(steps, len(prompt))

    for row in rows:  # warm-up: compile, load drafters
        once(row)
    for i in range(repeats):
        for row in rows if i % 2 == 0 else rows[::-1]:
            runs[row].append(once(row, prompt_drop(i, new_lengths)))
        progress(f"round {i + 1}/{repeats}: " + ", ".join(
            f"{row} {runs[row][-1].decode_tps:.1f}" for row in rows))
    table = []
    for row in rows:
        decode = statistics.median(r.decode_tps for r in runs[row])
        base_row, at, mode = row.partition("@")
        plain = bench_spec.plain_row(base_row) + at + mode
        base = statistics.median(r.decode_tps for r in runs[plain]) if plain in runs else None
        paired = [a.decode_tps / b.decode_tps for a, b in zip(runs[row], runs.get(plain, []))
                  if b.decode_tps > 0]
        table.append({
            "row": row, "decode_tps": decode,
            "vs_plain": decode / base if base else None,
            "vs_plain_paired_median": statistics.median(paired) if paired else None,
            "extras": runs[row][-1].extras,
            "runs": [r.decode_tps for r in runs[row]],
            "vs_plain_paired_runs": paired,
            "mean_k_runs": [(r.extras or {}).get("mean_k") for r in runs[row]],
        })
    return {"machine": machine_info(), "runtime": runtime_info(), "model": model,
            "prompt_tokens": prompt_tokens, "generated_tokens": max_tokens,
            "repeats": repeats, "num_draft_tokens": num_draft_tokens,
            "ngram_draft_tokens": bench_spec.drafted_up_to("ngram"),
            "mtp_draft_vocab": bench_spec.mtp_draft_vocab(job),
            "mtp_draft_tokens": bench_spec.drafted_up_to("mtp"), "adaptive": adaptive,
            "new_lengths": new_lengths, "rows": table}


def main(argv: list[str] | None = None) -> int:
    blas.preload()
    ap = argparse.ArgumentParser(prog="python benchmarks/spec_paired.py",
                                 description=foretell_only.__doc__)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft-model", default="demo-draft")
    ap.add_argument("--num-draft-tokens", type=int, default=4,
                    help="the most tokens the model drafters draft per round")
    ap.add_argument("--ngram-draft-tokens", type=int, default=None,
                    help="the most tokens the n-gram rows draft per round (default: the "
                         "drafter's own, 16)")
    ap.add_argument("--mtp-draft-vocab", type=int, default=None,
                    help=f"the MTP rows draft from the ids below this (0: the whole vocabulary; "
                         f"default {bench_spec.MTP_DRAFT_VOCAB} on a CPU, 0 on a GPU)")
    ap.add_argument("--mtp-draft-tokens", type=int, default=None,
                    help="the most tokens the MTP rows draft per round (default: the "
                         "drafter's own, 6)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--generate", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--row", action="append", default=None, choices=list(bench_spec.ROWS))
    ap.add_argument("--fixed-k", action="store_true",
                    help="draft the most tokens every round (no adaptive length)")
    ap.add_argument("--fixed-shapes-ab", action="store_true",
                    help="every row with fixed-shape verify forwards on and off, in turns "
                         "(foretell.model.fixed; on by default on CUDA)")
    ap.add_argument("--new-lengths", action="store_true",
                    help="round i runs every row on its prompt less the first i + 1 tokens, so "
                         "no timed run repeats an earlier one's shapes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    report = foretell_only(
        args.model, args.row or list(bench_spec.ROWS), prompt_tokens=args.prompt_tokens,
        max_tokens=args.generate, repeats=args.repeats, draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens, ngram_draft_tokens=args.ngram_draft_tokens,
        draft_vocab=args.mtp_draft_vocab, mtp_tokens=args.mtp_draft_tokens,
        adaptive=not args.fixed_k,
        fixed_shapes_ab=args.fixed_shapes_ab, new_lengths=args.new_lengths,
        progress=lambda line: print(line, file=sys.stderr, flush=True))
    for row in report["rows"]:
        ex = row["extras"] or {}
        ratio = f"{row['vs_plain']:.2f}x" if row["vs_plain"] else "-"
        print(f"{row['row']:<22} {row['decode_tps']:8.1f} tok/s  vs plain {ratio:>6}  "
              f"accept {ex.get('acceptance', 0):.0%}  tok/fwd {ex.get('tokens_per_forward', 1):.2f}"
              f"  mean k {ex.get('mean_k', 0):.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(portable(report), fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
