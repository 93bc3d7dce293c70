"""Block store vs single-file layout, in one run, on the shipped demo model (not a test).

    python benchmarks/layouts.py [--rounds 3] [--repeats 5] [--block-tokens N]
                                 [--sweep 64,128,256,1024] [--json out.json]

Workloads (issue 10): (a) 8 conversations sharing a 2,048-token system prompt (each prefix
reused from the first, as the tier's prefix cache hands it out); (b) one conversation
checkpointed after each of 8 turns. For each layout: bytes on disk, bytes written (the
write(2) bytes the process issued, /proc/self/io ``wchar``), total write time and total
verified read time (every entry read back and evaluated). Each round writes both layouts on
fresh directories (order flipping every round), then reads every entry back with the
layouts taking turns entry by entry; reported: medians over the rounds, and the median of
the per-round ratios to single-file (the 2-core host is shared, so pairs matter).

It also measures what chose the block identity and the read checksum: SHA-256, XXH3-128
(the block names), XXH3-64 and zlib's CRC-32 over the entries' bytes, and whether KV
computed from scratch (no prefix reuse) is byte-identical to the reused prefix, which
content naming needs to dedupe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import xxhash

SYSTEM_TOKENS = 2048
CONVERSATIONS = 8
USER_TOKENS = (180, 260, 310, 150, 400, 220, 330, 275)  # per conversation / per turn
TURN_TOKENS = 2 * 128  # a user message and a reply per turn in (b)
FIRST_TURN = 512


def _wchar() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "lock")


def _workloads(model, codecs, vocab: int, seed: int = 0):
    """Entries for (a) and (b), computed by the model; arrays evaluated."""
    import mlx.core as mx

    from foretell.cache.codecs import clone_caches, snapshot_entry

    rng = __import__("random").Random(seed)

    def tokens(n):
        return [rng.randrange(1, vocab) for _ in range(n)]

    def extend(caches, toks):
        model.forward(mx.array([toks]), caches)
        mx.eval([c.state for c in caches])

    system = tokens(SYSTEM_TOKENS)
    base = model.make_caches()
    extend(base, system)
    shared = []
    for n in USER_TOKENS:
        user = tokens(n)
        caches = clone_caches(base, codecs)
        extend(caches, user)
        shared.append(snapshot_entry(system + user, caches, codecs))

    history, caches, growing = tokens(FIRST_TURN), model.make_caches(), []
    extend(caches, history)
    growing.append(snapshot_entry(list(history), caches, codecs))
    for _ in range(CONVERSATIONS - 1):
        turn = tokens(TURN_TOKENS)
        extend(caches, turn)
        history += turn
        growing.append(snapshot_entry(list(history), caches, codecs))
        mx.eval([t for layer in growing[-1].layers for t in layer.tensors.values()])

    # Content naming dedupes only if the same prefix gives the same bytes: check a
    # conversation prefilled from scratch in one forward against the reused prefix.
    scratch = model.make_caches()
    extend(scratch, shared[1].tokens)
    diff = max(
        float(mx.max(mx.abs(a[..., :SYSTEM_TOKENS, :] - b[..., :SYSTEM_TOKENS, :])))
        for cs, cr in zip(scratch, clone_caches(base, codecs))
        for a, b in zip(cs.state, cr.state))
    return {"a_shared_prompt": shared, "b_growing_conversation": growing}, diff


def _write_all(layout, entries) -> dict:
    written0, write_s = _wchar(), 0.0
    for entry in entries:
        start = time.perf_counter()
        if not layout.write(entry):
            raise RuntimeError(f"{type(layout).__name__} failed to write an entry")
        write_s += time.perf_counter() - start
    written = (_wchar() - written0) if written0 is not None else None
    return {"bytes_written": written, "write_s": write_s}


def _read_interleaved(layouts: dict, entries, repeats: int) -> dict[str, float]:
    """Verified read time of every entry, per layout: the layouts take turns entry by entry
    (order flipping each repeat), so a slow spell on the shared host lands on all of them;
    each entry's time is the median of its repeats."""
    import mlx.core as mx

    times: dict[str, float] = dict.fromkeys(layouts, 0.0)
    for entry in entries:
        runs: dict[str, list[float]] = {side: [] for side in layouts}
        for rep in range(repeats):
            for side in (list(layouts) if rep % 2 == 0 else list(reversed(layouts))):
                layout = layouts[side]
                start = time.perf_counter()
                got = layout.read(layout.key_for(entry.tokens, entry.namespace))
                mx.eval([t for layer in got.layers for t in layer.tensors.values()])
                runs[side].append(time.perf_counter() - start)
                if got.tokens != entry.tokens:
                    raise RuntimeError("read back another entry")
                del got
        for side, values in runs.items():
            times[side] += statistics.median(values)
    return times


def _round(sides: dict, entries, root: Path, order: list[str], repeats: int) -> dict:
    """One round on fresh directories: each layout writes every entry (in ``order``), then
    all of them read every entry back, interleaved."""
    layouts = {side: sides[side](root / side) for side in order}
    out = {side: _write_all(layouts[side], entries) for side in order}
    for side, read_s in _read_interleaved(layouts, entries, repeats).items():
        out[side].update(read_s=read_s, disk_bytes=_disk_bytes(root / side))
    shutil.rmtree(root, ignore_errors=True)
    return out


def _summary(rounds: list[dict], side: str) -> dict:
    """Medians over the rounds, and the median of the per-round ratios to single-file (each
    round's pair shares whatever the host was doing)."""
    row = {k: statistics.median(r[side][k] for r in rounds) for k in rounds[0][side]
           if rounds[0][side][k] is not None}
    for k in ("write_s", "read_s"):
        row[f"{k[:-2]}_ratio"] = statistics.median(
            r[side][k] / r["single-file"][k] for r in rounds)
        row[f"{k}_rounds"] = [r[side][k] for r in rounds]
    return row


def _verify_equal(entries, make_layout, root: Path) -> None:
    """Every entry reads back bit-identical through the block store."""
    import numpy as np

    layout = make_layout(root)
    for entry in entries:
        layout.write(entry)
        got = layout.read(layout.key_for(entry.tokens))
        for want, have in zip(entry.layers, got.layers):
            for name, array in want.tensors.items():
                if not np.array_equal(np.asarray(array), np.asarray(have.tensors[name])):
                    raise RuntimeError(f"block store changed tensor {name}")


def _hash_costs(entries) -> dict:
    from foretell.store.format import host_bytes

    datas = [host_bytes(t) for e in entries for layer in e.layers for t in layer.tensors.values()]
    total = sum(d.nbytes for d in datas)
    costs = {}
    for name, fn in (("xxh3_64", xxhash.xxh3_64_intdigest), ("crc32", zlib.crc32),
                     ("xxh3_128", xxhash.xxh3_128_intdigest),
                     ("sha256", lambda d: hashlib.sha256(d).digest())):
        best = min(_timed(lambda fn=fn: [fn(d) for d in datas]) for _ in range(3))
        costs[name] = {"s": best, "GB_per_s": total / best / 1e9}
    return {"bytes": total, **costs}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/layouts.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5,
                        help="verified reads of each entry per layout and round")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="the measured block size (default: the layout's default)")
    parser.add_argument("--sweep", default="64,128,256,1024",
                        help="other block sizes measured once each ('' for none)")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a tmp dir)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from foretell.platform import blas

    blas.preload()  # before mlx: the CPU forward passes need the optimized BLAS
    import mlx.core as mx

    from foretell.cache.codecs import RotatingKVCodec, StandardKVCodec
    from foretell.engine import resolve_model_path
    from foretell.model.loading import load
    from foretell.store.entry import StoreIdentity
    from foretell.store.single_file import SingleFileLayout
    from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

    if args.block_tokens is None:
        args.block_tokens = BlockStoreConfig().block_tokens
    model_dir = resolve_model_path(args.model)
    model = load(model_dir)
    codecs = [StandardKVCodec(), RotatingKVCodec()]
    identity = StoreIdentity.for_model_dir(model_dir, model_id=args.model,
                                           codec_providers=[c.provider_id for c in codecs])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    start = time.perf_counter()
    workloads, scratch_diff = _workloads(model, codecs, vocab)
    compute_s = time.perf_counter() - start

    scratch = Path(args.dir or tempfile.mkdtemp(prefix="foretell-blockbench-"))
    scratch.mkdir(parents=True, exist_ok=True)

    def single(root):
        return SingleFileLayout(root, identity=identity)

    def blocks(size):
        return lambda root: BlockStoreLayout(root, BlockStoreConfig(block_tokens=size),
                                             identity=identity)

    results = {"machine": _machine(), "model": args.model, "mlx": mx.__version__,
               "kv_dtype": str(workloads["a_shared_prompt"][0].layers[0].tensors["keys"].dtype),
               "compute_s": compute_s, "scratch_fs": str(scratch),
               "scratch_prefill_max_abs_diff": scratch_diff, "workloads": {}}
    for name, entries in workloads.items():
        _verify_equal(entries, blocks(args.block_tokens), scratch / f"{name}-check")
        main_side = f"blocks@{args.block_tokens}"
        sides = {"single-file": single, main_side: blocks(args.block_tokens)}
        rounds = []
        for r in range(args.rounds):  # the layouts' write order flips every round
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            rounds.append(_round(sides, entries, scratch / f"{name}-{r}", order, args.repeats))
        row = {side: _summary(rounds, side) for side in sides}
        for size in [int(s) for s in args.sweep.split(",") if s.strip()]:
            swept = {"single-file": single, f"blocks@{size}": blocks(size)}
            one = _round(swept, entries, scratch / f"{name}-sweep-{size}", list(swept),
                         args.repeats)
            row[f"blocks@{size}"] = _summary([one], f"blocks@{size}")
        results["workloads"][name] = {
            "entries": len(entries), "tokens": [len(e.tokens) for e in entries],
            "logical_bytes": sum(e.tensor_bytes for e in entries), "layouts": row}
    results["hash_costs"] = _hash_costs(workloads["a_shared_prompt"])
    shutil.rmtree(scratch, ignore_errors=True)
    _print(results, args.block_tokens)
    if args.json:
        from foretell.tools.measure import portable

        Path(args.json).write_text(json.dumps(portable(results), indent=1))
    return 0


def _machine() -> str:
    import platform

    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or ''}".strip(", ")


def _print(results: dict, block_tokens: int) -> None:
    out = sys.stdout
    out.write(f"{results['machine']}; model {results['model']} (KV {results['kv_dtype']}), "
              f"mlx {results['mlx']}\n")
    main_side = f"blocks@{block_tokens}"
    for name, work in results["workloads"].items():
        out.write(f"\n{name}: {work['entries']} entries, {work['logical_bytes'] / 2**20:.1f} MiB "
                  f"of KV in all\n")
        out.write(f"  {'layout':<14}{'on disk MiB':>12}{'written MiB':>12}{'write s':>9}"
                  f"{'read s':>8}   vs single-file: disk  written  write  read\n")
        base = work["layouts"]["single-file"]
        for side, r in work["layouts"].items():
            mark = " *" if side == main_side else ""
            out.write(f"  {side + mark:<14}{r['disk_bytes'] / 2**20:>12.1f}"
                      f"{(r['bytes_written'] or 0) / 2**20:>12.1f}{r['write_s']:>9.3f}"
                      f"{r['read_s']:>8.3f}   "
                      f"{r['disk_bytes'] / base['disk_bytes']:>19.2f}"
                      f"{(r['bytes_written'] or 0) / (base['bytes_written'] or 1):>9.2f}"
                      f"{r['write_ratio']:>7.2f}{r['read_ratio']:>6.2f}\n")
    costs = results["hash_costs"]
    out.write(f"\nover {costs['bytes'] / 2**20:.0f} MiB: SHA-256 {costs['sha256']['GB_per_s']:.2f} "
              f"GB/s, XXH3-128 {costs['xxh3_128']['GB_per_s']:.2f}, XXH3-64 {costs['xxh3_64']['GB_per_s']:.2f}, CRC-32 (zlib) "
              f"{costs['crc32']['GB_per_s']:.2f}; "
              f"system-prompt KV prefilled from scratch vs reused: max |diff| "
              f"{results['scratch_prefill_max_abs_diff']:.3g}\n")


if __name__ == "__main__":
    raise SystemExit(main())
