"""Where a speculative round's time goes on this machine (not a test).

    python benchmarks/round_probe.py [--model demo] [--draft mtp] [--num-draft-tokens 3]
                                     [--temp 0.8] [--trace N] [--gaps MS] [--plain-steps]

1. Plain decoding and the drafter at a fixed draft length, in turns: tok/s, and per token
   (plain) or per round the wall time, the time inside ``mx.async_eval`` (on CUDA MLX encodes
   every graph node there, on the calling thread, so it is host time) and the time the
   round's one sync waits for the device. ``--plain-steps`` adds the drafter with its policy
   pinned to k = 0: what the speculative loop itself costs over plain decoding.
2. The adaptive policy's own figures after a few requests with the adaptive length: the
   round time it keeps per draft length and its acceptance per draft position.
3. With ``--trace N``, the first ``N`` things the policy was told and chose in the first
   adaptive request, in order (why a drafter went off, or stayed off).
4. With ``--gaps MS``, each adaptive request's waits of more than ``MS`` ms between tokens,
   by position in the sequence: where a one-off stall falls, marked where a fixed-shape
   forward traced a new shape meanwhile.

It measures by wrapping ``mx.async_eval`` and the verify step
(:func:`foretell.spec.batch.verify_rows`) for its own runs and puts both back afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from typing import Any


@contextlib.contextmanager
def _timed_host_work(spent: dict[str, list[float]]):
    """Append the seconds each ``mx.async_eval`` call takes to ``spent["encode"]`` and those
    each round's sync waits for the device (the ``mx.eval`` inside the verify step,
    :func:`foretell.spec.batch.verify_rows`) to ``spent["wait"]``, while inside. The
    scheduler's worker runs both; the caller only reads events meanwhile."""
    import mlx.core as mx

    from foretell.spec import batch
    from foretell.tools.measure import timed

    real_async, real_verify, real_eval = mx.async_eval, batch.verify_rows, mx.eval
    async_eval = timed(real_async, spent["encode"])
    wait = timed(real_eval, spent["wait"])

    def verify_rows(*args: Any, **kwargs: Any) -> Any:
        mx.eval = wait  # the round's one sync
        try:
            return real_verify(*args, **kwargs)
        finally:
            mx.eval = real_eval

    mx.async_eval, batch.verify_rows = async_eval, verify_rows
    try:
        yield
    finally:
        mx.async_eval, batch.verify_rows = real_async, real_verify


def _generate(engine: Any, prompt: list[int], tokens: int, speculate: Any,
              gaps: list[tuple[int, float, bool]] | None = None, over_ms: float = 0.0,
              sampling: Any = None) -> Any:
    """Run one request; its stats. ``gaps`` collects ``(position, ms, traced)`` for every
    wait of more than ``over_ms`` between two text events that carry tokens: the position
    (tokens in the sequence, prompt included) the later event reached, so a stall shows
    where in the sequence it happened (a round's burst is one event), and whether a
    fixed-shape forward traced a new shape in that wait (:func:`foretell.model.fixed.trace_count`)."""
    from foretell.model import fixed

    stats, last, position = None, None, len(prompt)
    traces = fixed.trace_count()
    for event in engine.generate(prompt, max_tokens=tokens, ignore_eos=True,
                                 speculate=speculate, sampling=sampling):
        if event.type == "stats":
            stats = event
        elif gaps is not None and event.tokens:
            now, position = time.perf_counter(), position + len(event.tokens)
            seen, traces = traces, fixed.trace_count()
            if last is not None and (now - last) * 1e3 > over_ms:
                gaps.append((position, (now - last) * 1e3, traces != seen))
            last = now
    return stats


def host_split(engine: Any, prompt: list[int], tokens: int, rows: dict[str, Any],
               repeats: int, sampling: Any = None) -> list[dict[str, Any]]:
    """Per row (None: plain decoding), medians over ``repeats`` turns: tok/s, and per token
    or round the wall, encode and wait times in ms; ``sampling`` as for ``generate``."""
    runs: dict[str, list[tuple[float, ...]]] = {name: [] for name in rows}
    for _name, speculate in rows.items():  # warm-up
        _generate(engine, prompt, tokens, speculate, sampling=sampling)
    for turn in range(repeats):
        for name, speculate in (rows.items() if turn % 2 == 0 else list(rows.items())[::-1]):
            spent: dict[str, list[float]] = {"encode": [], "wait": []}
            with _timed_host_work(spent):
                stats = _generate(engine, prompt, tokens, speculate, sampling=sampling)
            spec = stats.speculation
            decoded = stats.generated_tokens - 1  # generation_tps times what follows the first
            units = spec["target_forwards"] if spec else decoded
            wall = decoded / stats.generation_tps
            runs[name].append((stats.generation_tps, wall / units * 1e3,
                               sum(spent["encode"]) / units * 1e3, sum(spent["wait"]) / units * 1e3,
                               spec["tokens_per_target_forward"] if spec else 1.0))
    table = []
    for name, samples in runs.items():
        median = [statistics.median(s[i] for s in samples) for i in range(5)]
        table.append({"row": name, "tps": median[0], "wall_ms": median[1],
                      "encode_ms": median[2], "wait_ms": median[3],
                      "tokens_per_round": median[4], "per": "round" if rows[name] else "token"})
    return table


@contextlib.contextmanager
def _traced_policy(policy: Any, events: list[str]):
    """Append to ``events`` each choice ``policy`` makes and each round it is told of,
    while inside (the policy instance only; the class stays as it is)."""
    choose, observe = policy.choose, policy.observe

    def traced_choose(limit: int) -> int:
        k = choose(limit)
        known = ", ".join(f"{n}: {t * 1e3:.2f}" for n, t in policy.measured().items())
        events.append(f"choose {k} (ms per round by k {{{known}}})")
        return k

    def traced_observe(drafted: int, accepted: int, seconds: float, *,
                       one_off: bool = False, fed: bool = False) -> None:
        what = f"drafted {drafted}, kept {accepted}" if drafted else "plain step"
        events.append(f"{what}: {seconds * 1e3:.2f} ms" + (" (one-off)" if one_off else "")
                      + (" (fed the drafter)" if fed else ""))
        observe(drafted, accepted, seconds, one_off=one_off, fed=fed)

    policy.choose, policy.observe = traced_choose, traced_observe
    try:
        yield
    finally:
        del policy.choose, policy.observe


def policy_figures(engine: Any, prompt: list[int], tokens: int, speculator: Any,
                   requests: int, events: list[str] | None = None,
                   gaps_over_ms: float | None = None, sampling: Any = None) -> list[dict[str, Any]]:
    """After each of ``requests`` adaptive requests: tok/s, mean k, and what the policy
    keeps (ms per round by draft length, acceptance per draft position). ``events``
    collects what the policy was told and chose during the first request. With
    ``gaps_over_ms``, each request's waits over that many ms between tokens, by position
    (``"gaps"``: where a one-off stall falls)."""
    out = []
    for i in range(requests):
        traced = i == 0 and events is not None
        gaps: list[tuple[int, float, bool]] | None = [] if gaps_over_ms is not None else None
        with _traced_policy(speculator.policy, events) if traced else contextlib.nullcontext():
            stats = _generate(engine, prompt, tokens, speculator, gaps, gaps_over_ms or 0.0,
                              sampling)
        policy = speculator.policy
        out.append({"tps": stats.generation_tps, "mean_k": stats.speculation["mean_k"],
                    "round_ms": {n: t * 1e3 for n, t in policy.measured().items()},
                    "acceptance": policy.acceptance(), "gaps": gaps})
    return out


def main(argv: list[str] | None = None) -> int:
    from foretell.platform import blas

    blas.preload()
    from foretell.config import SamplingConfig
    from foretell.engine import load
    from foretell.plugin.registry import Kind
    from foretell.tools.bench_spec import code_prompts

    ap = argparse.ArgumentParser(prog="python benchmarks/round_probe.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default="mtp", help="the draft provider (its default options)")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=992)
    ap.add_argument("--generate", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4,
                    help="adaptive requests before the policy's figures are read")
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="print the first N choices and rounds of the first adaptive request")
    ap.add_argument("--gaps", type=float, default=None, metavar="MS",
                    help="print each adaptive request's waits of more than MS ms between "
                         "tokens, by position in the sequence (where a one-off stall falls)")
    ap.add_argument("--plain-steps", action="store_true",
                    help="add a row whose policy always chooses k = 0: the speculative "
                         "loop's plain steps against plain decoding (its own host time)")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sample at this temperature (seeded), rejection sampling verifying")
    args = ap.parse_args(argv)
    sampling = SamplingConfig(temp=args.temp, seed=0) if args.temp > 0 else None
    engine = load(args.model)
    prompt = code_prompts(engine.tokenizer, args.prompt_tokens)["code"]
    config = engine.registry.get(Kind.DRAFT, args.draft).config
    options = config() if config is not None else None

    def speculator(adaptive: bool) -> Any:
        made = engine.use_draft(args.draft, options, max_tokens=args.num_draft_tokens,
                                adaptive=adaptive)
        engine.use_draft(None)
        return made

    rows = {"plain": None, f"{args.draft} k={args.num_draft_tokens}": speculator(False)}
    if args.plain_steps:
        pinned = speculator(True)
        pinned.policy.choose = lambda _limit: 0  # this throwaway speculator never drafts
        rows[f"{args.draft} k=0"] = pinned
    for row in host_split(engine, prompt, args.generate, rows, args.repeats, sampling):
        print(f"{row['row']:<16} {row['tps']:8.1f} tok/s; per {row['per']}: wall "
              f"{row['wall_ms']:.2f} ms, inside async_eval {row['encode_ms']:.2f} ms, "
              f"waiting {row['wait_ms']:.2f} ms ({row['tokens_per_round']:.2f} tokens)")
    adaptive = speculator(True)
    events: list[str] = []
    for i, seen in enumerate(policy_figures(engine, prompt, args.generate, adaptive,
                                            args.requests, events, args.gaps, sampling)):
        times = ", ".join(f"{n}: {t:.2f}" for n, t in seen["round_ms"].items())
        rates = ", ".join(f"{a:.2f}" for a in seen["acceptance"])
        print(f"adaptive request {i + 1}: {seen['tps']:.1f} tok/s, mean k {seen['mean_k']:.2f}; "
              f"policy: ms per round by k {{{times}}}, acceptance by position [{rates}]")
        if seen["gaps"] is not None:
            found = ", ".join(f"{at}: {ms:.1f}" + (" traced" if traced else "")
                              for at, ms, traced in seen["gaps"])
            print(f"  waits over {args.gaps:g} ms between tokens (position: ms, 'traced' where "
                  f"a fixed-shape forward traced a new shape): [{found}]")
    for event in events[: args.trace]:
        print(f"  {event}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
