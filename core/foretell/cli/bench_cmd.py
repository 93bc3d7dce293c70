"""``foretell bench``: foretell vs mlx-lm on the same weights, printed as one table."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from foretell.errors import BenchError

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="prefill/decode speed of foretell vs mlx-lm on the same weights",
        description="Run foretell and mlx-lm, each in its own process, on the same weights, "
        "prompt token ids and generated-token count; print median tok/s and ratios.",
    )
    p.add_argument("--model", action="append", default=[], metavar="PATH",
                   help="a model directory (or shipped model name); repeatable (default: with "
                        "no --synthetic either, the shipped demo)")
    p.add_argument("--synthetic", default="", metavar="SHAPES",
                   help="random-weight shapes the architecture plugins name, comma-separated "
                        "(e.g. 30m,150m); MODEL_TYPE:SHAPE picks the architecture (default: "
                        "none)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of synthetic weights (bfloat16 on a GPU)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=None,
                   help="store synthetic weights quantized to this many bits (MLX affine, "
                        "groups of 64, as mlx_lm.convert -q; scales in --dtype; default: "
                        "unquantized)")
    p.add_argument("--prompt-tokens", type=int, default=128, metavar="N",
                   help="prompt length: random token ids, the same for both sides")
    p.add_argument("--generate", type=int, default=64, metavar="N", dest="max_tokens",
                   help="tokens each side generates (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, metavar="N",
                   help="timed runs after one warm-up; the median is reported")
    p.add_argument("--speculation", action="store_true",
                   help="add the speculation rows: plain, two-model, self-draft, MTP, n-gram on "
                        "a code-editing prompt, sampled (vs mlx-lm's speculative decoding)")
    p.add_argument("--draft-model", default="demo-draft", metavar="PATH",
                   help="the two-model rows' draft, a directory or shipped model name")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="N",
                   help="draft tokens per round on both sides")
    p.add_argument("--scenario", action="append", default=None, metavar="NAME",
                   help="run only these rows (repeatable): greedy or a speculation row "
                        "(default: greedy, plus the speculation rows with --speculation)")
    p.add_argument("--sequential", action="store_true",
                   help="run one side after the other instead of alternating their timed "
                        "runs (holds one copy of the model in memory instead of two)")
    p.add_argument("--new-lengths", action="store_true",
                   help="each timed round runs the prompt less its first 1, 2, ... tokens, "
                        "counting on from row to row, the same on both sides, so no run "
                        "repeats a shape the process has run (a GPU keeps its kernels' plans "
                        "per shape, which a repeated prompt length reuses)")
    p.add_argument("--cold-mlx-lm", action="store_true",
                   help="mlx-lm's speculative rows run each timed run in a fresh process "
                        "warmed up on a 32-token prompt, so its verify windows meet no kernel "
                        "plan an earlier run left (what a user's first request meets; "
                        "without it later rows reuse earlier rows' plans on a GPU)")
    p.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                   help="where --synthetic models are made once and kept (default: "
                        "~/.cache/foretell/bench)")
    # `--cache-dir` names a KV cache directory everywhere else (run, chat, cache): one name,
    # one meaning. Kept only to say what it became.
    p.add_argument("--cache-dir", dest="renamed_cache_dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", action="store_true",
                   help="the prefix-cache rows instead: TTFT cold / RAM hit / SSD restore in a "
                        "fresh process, restore vs dd, mlx-lm prompt-cache files, decode "
                        "during a background write (foretell.tools.bench_cache)")
    p.add_argument("--cache-prompt-tokens", type=int, default=4096, metavar="N",
                   help="with --cache: the long prompt's length")
    p.add_argument("--layout", default=None, metavar="NAME",
                   help="with --cache: the storage layout to measure, by its registered name "
                        "(`foretell plugins`; default: the tier's default, blocks)")
    p.add_argument("--reserve-ab", action="store_true",
                   help="with --cache: every fresh-process restore also runs with the restore "
                        "reserve off (FORETELL_RESTORE_RESERVE_MB=0), taking turns with it on")
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 8), metavar="N",
                   help="with --cache: run every phase with the KV quantized to N bits (4 or 8), "
                        "as `foretell run --kv-bits N` does, so the entry holds that KV "
                        "(default: unquantized)")
    p.add_argument("--batch", default=None, metavar="SIZES",
                   help="the batch rows instead: B requests at once for each B of SIZES "
                        "(e.g. 1,2,4,8,16,32), foretell's scheduler vs mlx-lm's BatchGenerator "
                        "(on the CPU on a float32 copy of the weights, same BLAS): aggregate "
                        "decode tok/s, TTFT p50/p99 (foretell.tools.bench_batch; default: "
                        "none, no batch rows)")
    p.add_argument("--batch-drafts", default="none", metavar="NAMES",
                   help="with --batch: foretell sides to run, comma-separated drafter names or "
                        "none (plain), e.g. none,two-model,mtp")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="the full report (every run) as JSON: on stdout instead of the table, "
                        "or, given FILE, written there beside the table (default: the table only)")
    p.set_defaults(handler=run)


#: What `pip install .` lacks for `foretell bench`: the reference it measures against.
BENCH_EXTRA = "pip install '.[bench]' (from the foretell checkout; installs mlx-lm)"


def require_mlx_lm() -> None:
    import importlib.util

    if importlib.util.find_spec("mlx_lm") is None:
        raise BenchError(
            f"foretell bench compares against mlx-lm, which is not installed: {BENCH_EXTRA}"
        )


@contextlib.contextmanager
def naming_the_file(flag: str, path: Path) -> Iterator[None]:
    """An OSError writing under ``path`` (what ``flag`` names) is one error naming both."""
    try:
        yield
    except OSError as exc:
        inner = f"{exc.filename}: " if exc.filename and str(exc.filename) != str(path) else ""
        raise BenchError(f"{flag} {path}: {inner}{exc.strerror or exc}") from None


def run(args) -> int:
    from foretell.cli.run_cmd import model_path
    from foretell.tools import bench, measure

    require_mlx_lm()

    for name, flag in (("prompt_tokens", "--prompt-tokens"), ("max_tokens", "--generate"),
                       ("repeats", "--repeats"), ("num_draft_tokens", "--num-draft-tokens")):
        if getattr(args, name) < 1:
            raise BenchError(f"{flag} must be >= 1")
    if args.renamed_cache_dir is not None:
        raise BenchError(
            f"--cache-dir {args.renamed_cache_dir}: bench calls it --models-dir (where "
            "--synthetic models are kept); --cache-dir names a KV cache directory in `foretell "
            "run`, `chat` and `cache`")
    models = [(Path(m).name or m, model_path(m)) for m in args.model]
    models_dir = args.models_dir or measure.CACHE_DIR
    for preset in filter(None, (s.strip() for s in args.synthetic.split(","))):
        from foretell.tools.synthetic import presets

        shapes = presets()
        model_type, _, name = preset.rpartition(":")
        if (model_type, name) not in {(t, n) for n, t in shapes.items()} | {("", n) for n in shapes}:
            raise BenchError(
                f"--synthetic {preset}: unknown shape "
                f"(known: {', '.join(f'{n} ({t})' for n, t in shapes.items())})"
            )
        packed = f", {args.bits}-bit" if args.bits else ""
        print(f"synthetic {preset} ({args.dtype}{packed}) in {models_dir}", file=sys.stderr)
        with naming_the_file("--models-dir", models_dir):
            path = measure.synthetic_model(preset, args.dtype, models_dir, bits=args.bits)
        models.append((f"{name}-q{args.bits}" if args.bits else name, path))
    if not models:  # as `foretell run`: the shipped default
        from foretell.engine import DEFAULT_MODEL

        print(f"no --model or --synthetic: the shipped {DEFAULT_MODEL!r}", file=sys.stderr)
        models = [(DEFAULT_MODEL, model_path(None))]
    to_file = Path(args.json) if args.json not in (None, "-") else None
    if args.bits is not None and not args.synthetic:
        raise BenchError("--bits quantizes the weights of --synthetic models; add --synthetic")
    if args.layout is not None and not args.cache:
        raise BenchError("--layout picks the storage layout of --cache; add --cache")
    if args.reserve_ab and not args.cache:
        raise BenchError("--reserve-ab compares restores of --cache; add --cache")
    if args.kv_bits is not None and not args.cache:
        raise BenchError("--kv-bits quantizes the KV of --cache's runs; add --cache")
    if args.batch is not None:
        return _run_batch(args, models, to_file)
    if args.cache:
        from foretell.tools import bench_cache

        report = bench_cache.run_cache_bench(
            models, prompt_tokens=args.cache_prompt_tokens, repeats=args.repeats,
            decode_tokens=args.max_tokens, layout=args.layout, reserve_ab=args.reserve_ab,
            kv_bits=args.kv_bits, progress=lambda line: print(line, file=sys.stderr, flush=True))
        if to_file is not None:
            with naming_the_file("--json", to_file):
                to_file.write_text(json.dumps(measure.portable(report), indent=2))
        print(json.dumps(measure.portable(report), indent=2) if args.json == "-" else bench_cache.render(report))
        return 0
    scenarios = list(args.scenario or (["greedy"] + (list(bench.SPECULATION) if args.speculation else [])))
    known = [s.name for s in bench.SCENARIOS]
    unknown = [s for s in scenarios if s not in known]
    if unknown:
        raise BenchError(f"--scenario {unknown[0]}: unknown (known: {', '.join(known)})")

    def save(report: dict) -> None:
        if to_file is not None:
            with naming_the_file("--json", to_file):
                to_file.parent.mkdir(parents=True, exist_ok=True)
                to_file.write_text(json.dumps(measure.portable(report), indent=2))

    try:
        report = bench.run_bench(
            models,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            interleave=not args.sequential,
            new_lengths=args.new_lengths,
            cold_mlx_lm=args.cold_mlx_lm,
            scenarios=scenarios,
            draft={"draft_model": str(model_path(args.draft_model, "--draft-model")),
                   "num_draft_tokens": args.num_draft_tokens},
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            on_model=save,
        )
    except RuntimeError as exc:
        raise BenchError(str(exc)) from exc
    print(json.dumps(measure.portable(report), indent=2) if args.json == "-" else bench.render(report))
    return 0


def _run_batch(args, models: list, to_file: Path | None) -> int:
    from foretell.cli.run_cmd import model_path
    from foretell.platform.device import on_cpu
    from foretell.tools import bench_batch, measure

    try:
        batches = [int(b) for b in args.batch.split(",") if b.strip()]
    except ValueError:
        raise BenchError(f"--batch {args.batch}: batch sizes are integers, e.g. 1,2,4,8") from None
    if not batches or min(batches) < 1:
        raise BenchError(f"--batch {args.batch}: batch sizes are integers >= 1")
    drafts = [None if d.strip() == "none" else d.strip() for d in args.batch_drafts.split(",")]
    reports = []
    for _, path in models:
        report = bench_batch.run_batch_bench(
            path, batches=batches, prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens, repeats=args.repeats, drafts=drafts,
            draft_model=str(model_path(args.draft_model, "--draft-model")),
            k=args.num_draft_tokens, float32_mlx_lm=on_cpu(),
            progress=lambda line: print(line, file=sys.stderr, flush=True))
        reports.append(report)
        print(json.dumps(measure.portable(report), indent=2) if args.json == "-"
              else bench_batch.render(report))
    if to_file is not None:
        with naming_the_file("--json", to_file):
            to_file.parent.mkdir(parents=True, exist_ok=True)
            to_file.write_text(json.dumps(measure.portable(reports), indent=2))
    return 0
