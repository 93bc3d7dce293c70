"""Command line: ``python -m foretell_demo_train run|redraft|remtp|pack|unpack``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .presets import PRESETS, preset_from_args


def _run(args) -> None:
    import torch

    from .pipeline import STAGES, Run, run_stages

    preset = preset_from_args(args)
    if args.distill_ce_weight is not None:
        for cfg in preset.distill.values():
            cfg["ce_weight"] = args.distill_ce_weight
    if args.batch_size:
        for cfg in preset.train.values():
            cfg["batch_size"] = args.batch_size
    stages = STAGES if args.stages == "all" else args.stages.split(",")
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}; choose from {STAGES}")
    minutes = dict(preset.budgets_min)
    for name in minutes:
        value = getattr(args, f"{name}_minutes")
        if value is not None:
            minutes[name] = value
    torch.manual_seed(args.seed)
    run = Run(preset=preset, work=Path(args.work), out=Path(args.out), seed=args.seed,
              compile=args.compile, roots=args.roots, t0=time.time())
    run.log(f"foretell-demo-train: preset {args.preset}, stages {stages}, minutes {minutes}, "
            f"cuda {torch.cuda.is_available()}")
    run_stages(run, [s for s in STAGES if s in stages], minutes)
    if args.pack_dir:
        from .pack import pack

        pack(Path(args.out), Path(args.pack_dir), log=run.log)
    run.log("finished")


def _redraft(args) -> None:
    from .redraft import redraft

    redraft(args)


def _remtp(args) -> None:
    from .remtp import remtp

    remtp(args)


def _pack(args) -> None:
    from .pack import pack

    pack(Path(args.out), Path(args.pack_dir))


def _unpack(args) -> None:
    from .pack import unpack

    unpack(Path(args.pack_dir), Path(args.dest))


def _against_shipped_target(parser: argparse.ArgumentParser, name: str, packed: str) -> None:
    """The options every command training against a shipped target takes."""
    parser.add_argument("--target-dir", required=True, help="the shipped target's model dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--work", default=f"build/{name}")
    parser.add_argument("--out", default=f"build/{name}-out")
    parser.add_argument("--max-files", type=int, default=None, help="corpus subset (0: all)")
    parser.add_argument("--roots", nargs="*", default=None,
                        help="corpus roots (default: sysconfig+site)")
    parser.add_argument("--eval-windows", type=int, default=None)
    parser.add_argument("--gen-prompts", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pack-dir", default=None, help=f"pack {packed} into <= 8 files here")


def main(argv: list[str] | None = None) -> None:
    sys.stdout.reconfigure(line_buffering=True)
    ap = argparse.ArgumentParser(prog="foretell-demo-train", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run pipeline stages")
    r.add_argument("--preset", choices=sorted(PRESETS), default="full")
    r.add_argument("--work", default="build/demo-train", help="work dir (caches, checkpoints)")
    r.add_argument("--out", default="build/demo-out", help="output dir (model dirs, quality.json)")
    r.add_argument("--stages", default="all",
                   help="comma list of prepare,target,draft,mtp,gemma,export (or 'all')")
    for name in ("target", "draft", "mtp", "gemma"):
        r.add_argument(f"--{name}-minutes", type=float, default=None,
                       help=f"training time budget of the {name} (minutes)")
    r.add_argument("--max-files", type=int, default=None, help="corpus subset (0: all)")
    r.add_argument("--roots", nargs="*", default=None, help="corpus roots (default: sysconfig+site)")
    r.add_argument("--eval-windows", type=int, default=None, help="held-out windows to evaluate")
    r.add_argument("--gen-prompts", type=int, default=None,
                   help="prompts for the greedy-path acceptance measurement")
    r.add_argument("--batch-size", type=int, default=None, help="override every model's batch")
    r.add_argument("--distill-ce-weight", type=float, default=None,
                   help="weight of the data cross-entropy in distilled models (1.0: no teacher)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--compile", action="store_true", help="torch.compile the training step")
    r.add_argument("--pack-dir", default=None, help="also pack the output into <= 8 files here")
    r.set_defaults(fn=_run)
    d = sub.add_parser("redraft", help="train draft candidates against a shipped target")
    d.add_argument("--shape", action="append", required=True,
                   help="LABEL:layers=N,hidden=N,heads=N,kv_heads=N,head_dim=N,ffn=N "
                        "(repeatable: one candidate each)")
    d.add_argument("--minutes", type=float, default=2.25, help="training budget per candidate")
    d.add_argument("--seq-len", type=int, default=None,
                   help="training window (default: the preset's); a shallow draft attends "
                        "badly past the distances it trained on")
    d.add_argument("--batch-size", type=int, default=None, help="windows per step")
    _against_shipped_target(d, "redraft", "the candidates")
    d.set_defaults(fn=_redraft)
    m = sub.add_parser("remtp", help="retrain the MTP head, chained, against a shipped target")
    m.add_argument("--minutes", type=float, default=3.0, help="training budget")
    m.add_argument("--depth", type=int, default=5,
                   help="chained steps trained (and measured) from every anchor")
    m.add_argument("--decay", type=float, default=0.8,
                   help="step j's loss weighs decay ** (j - 1)")
    m.add_argument("--seq-len", type=int, default=1024,
                   help="training window: the head attends over the prompt it drafts after")
    m.add_argument("--batch-size", type=int, default=64, help="windows per step")
    m.add_argument("--lr", type=float, default=1e-3)
    m.add_argument("--warmup-steps", type=int, default=50)
    m.add_argument("--from-scratch", action="store_true",
                   help="start from the target's last layer instead of the shipped head")
    m.add_argument("--eval-prompt-tokens", type=int, nargs="+", default=[256, 960],
                   help="prompt lengths of the greedy-path measurement")
    _against_shipped_target(m, "remtp", "the result")
    m.set_defaults(fn=_remtp)
    p = sub.add_parser("pack", help="pack <out> into <= 8 files of <= 15 MiB")
    p.add_argument("--out", default="build/demo-out")
    p.add_argument("--pack-dir", required=True)
    p.set_defaults(fn=_pack)
    u = sub.add_parser("unpack", help="reassemble packed parts into a directory")
    u.add_argument("--pack-dir", required=True)
    u.add_argument("--dest", required=True)
    u.set_defaults(fn=_unpack)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.fn(args)
