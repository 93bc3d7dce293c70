"""The adaptive draft length against fixed lengths on held-out code prompts, in paired rounds.

    python benchmarks/adaptive_length.py [--prompt FILE@OFFSET ...] [--chars 1000]
                                         [--generate 96] [--rounds 5] [--json FILE]
    python benchmarks/adaptive_length.py --agreement 160

One process, the demo target with its two-model drafter (``demo-draft``, up to 4 a round).
Each round runs, per prompt, plain decoding, the default adaptive length with a fresh policy
(a process with no memory: ``foretell run --no-policy-memory``), the default with a fresh
policy that recalled the state the previous such run stored (``foretell run``: each run is a
process, :mod:`foretell.spec.memory`; the chain starts from ``--teach`` runs on a prompt
that is never timed), the default with the policy kept across this process's requests (what
a library user or server gets: the speculator's policy outlives a request), and fixed k = 3
and k = 4, the order flipping per round. Then the cases where drafting cannot pay, each
paired with plain decoding on the first prompt: the demo drafting for itself, prompt lookup
finding nothing (a drafter whose every draft is empty) and a drafter that never agrees (the
demo draft, each token shifted by one id), each fresh, kept, and recalling the state the
paying runs above stored (the prior must not keep them drafting). Rows report decode tok/s
per round and their median; ratios are taken within a round. Numbers only, never
assertions.

The prompts are 1,000 characters of this repository's own modules (not in the demo's
training corpus, docs/demo-models.md); their text goes into the JSON. ``--agreement`` prints,
instead, where the draft agrees with the target position by position (:func:`agreement`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from foretell.platform import blas

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ("core/foretell/model/batch.py@500", "core/foretell/engine.py@9000")
#: ``--agreement``'s prompts (the first two are PROMPTS).
AGREEMENT_PROMPTS = (*PROMPTS, "core/foretell/cache/tier.py@6000",
                     "core/foretell/sampling.py@3000", "core/foretell/scheduler.py@5000",
                     "core/foretell/config.py@8000", "core/foretell/spec/acceptance.py@2000",
                     "core/foretell/tokenizer.py@1500")


class _Shifted:
    """A source whose drafts are its wrapped source's, each id moved by one: it never
    agrees with the target, at the wrapped drafter's cost."""

    def __init__(self, source: Any, vocab: int):
        self._source, self._vocab = source, vocab

    def draft(self, feed: Any, n: int) -> Any:
        from foretell.spec.contract import Draft

        draft = self._source.draft(feed, n)
        return Draft((draft.tokens + 1) % self._vocab, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


class _Nothing:
    def prefill(self, feed: Any) -> None:
        pass

    def draft(self, feed: Any, n: int) -> Any:
        from foretell.spec.contract import Draft

        return Draft.of([])

    def commit(self, accepted: int) -> None:
        pass

    def close(self) -> None:
        pass


class FindsNothing:
    """Prompt lookup that never finds a match: every draft is empty."""

    requires: frozenset[str] = frozenset()

    def prepare(self, target: Any) -> None:
        pass

    def open(self, target: Any, sampler: Any) -> _Nothing:
        return _Nothing()


class NeverAgrees:
    """A provider wrapping another, whose drafts never agree (:class:`_Shifted`)."""

    def __init__(self, provider: Any):
        self._provider = provider
        self.requires = provider.requires

    def prepare(self, target: Any) -> None:
        self._provider.prepare(target)

    def open(self, target: Any, sampler: Any) -> _Shifted:
        return _Shifted(self._provider.open(target, sampler), target.model.vocab_size)


#: The prompt the recalled row's memory is first taught on (never timed).
TEACH_PROMPT = "core/foretell/cache/tier.py@6000"


class Remembering:
    """A row each of whose runs is a new ``foretell run`` process: a fresh policy that
    recalled ``state`` (through JSON, as the file keeps it), and with ``keep``, the state it
    stored replaces it (:meth:`done`)."""

    def __init__(self, base: Any, state: dict | None = None, keep: bool = True):
        self.base, self.state, self.keep, self.last = base, state, keep, None

    def __call__(self) -> Any:
        import attrs

        self.last = attrs.evolve(self.base)
        if self.state is not None:
            self.last.policy.recall(json.loads(json.dumps(self.state)))
        return self.last

    def done(self) -> None:
        if self.keep and self.last is not None:
            self.state = self.last.policy.state() or self.state


#: The drafted rounds a fresh policy runs before its first choice (policy.WARMUP_ROUNDS).
WARMUP = 3


def spent(told: list[tuple[int, int, float, str]], tokens: int) -> dict[str, float] | None:
    """Where a run's time went, from what its policy was told: the shares of the rounds'
    time (drafted rounds as timed, plain stretches at their timed step a token) spent in the
    warm-up's drafted rounds and in plain steps, the plain tokens, and the tokens a drafted
    round made after the warm-up. The tokens no drafted round made were plain steps; None
    for a run that was told nothing."""
    drafted = [(k, kept, ms) for k, kept, ms, _use in told if k]
    plain = sorted(ms for k, _kept, ms, _use in told if not k)
    made = sum(1 + kept for _k, kept, _ms in drafted)
    plain_tokens = max(tokens - made, 0)
    # A plain step's time: the run's own timed steps, else a drafted round's least.
    step = statistics.median(plain) if plain else min((ms for *_x, ms in drafted), default=0.0)
    total = sum(ms for *_x, ms in drafted) + plain_tokens * step
    if not total:
        return None
    after = drafted[WARMUP:]
    return {"warmup": sum(ms for *_x, ms in drafted[:WARMUP]) / total,
            "plain": plain_tokens * step / total, "plain_tokens": plain_tokens,
            "per_round": sum(1 + kept for _k, kept, _ms in after) / len(after) if after else 0.0}


def read_prompt(spec: str, chars: int) -> str:
    path, _, offset = spec.partition("@")
    return (ROOT / path).read_text(encoding="utf-8")[int(offset or 0):][:chars]


def agreement(specs: list[str], chars: int, tokens: int) -> dict[str, str]:
    """Per prompt, where the demo draft agrees with the demo target along the target's
    greedy continuation ("1": the draft's greedy token given the true text so far is the
    target's): what a greedy round drafting from that position keeps is the run of 1s there,
    whatever the length policy, so a simulation can replay it (tests/spec/test_policy.py)."""
    import mlx.core as mx

    from foretell.engine import load

    target, draft = load("demo"), load("demo-draft")
    found = {}
    for spec in specs:
        ids = target.encode_prompt(read_prompt(spec, chars))
        made: list[int] = []
        for event in target.generate(ids, max_tokens=tokens, ignore_eos=True, speculate=False):
            if event.type == "text" and event.tokens:
                made += list(event.tokens)
        hidden, _ = draft.model.forward(mx.array([ids + made[:-1]]), draft.model.make_caches())
        guess = mx.argmax(draft.model.logits(hidden)[0, len(ids) - 1 :], axis=-1).tolist()
        found[spec] = "".join("1" if g == t else "0" for g, t in zip(guess, made))
        print(f"{spec}: {found[spec]}")
    return found


def main(argv: list[str] | None = None) -> int:
    blas.preload()  # before MLX: else a slow reference BLAS
    ap = argparse.ArgumentParser(prog="python benchmarks/adaptive_length.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", action="append", default=None,
                    help="FILE@OFFSET: CHARS characters of FILE (relative to the repository) "
                         f"from OFFSET; default {' and '.join(PROMPTS)}")
    ap.add_argument("--chars", type=int, default=1000)
    ap.add_argument("--generate", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-cannot-pay", action="store_true")
    ap.add_argument("--teach", type=int, default=3,
                    help=f"runs on {TEACH_PROMPT} that start the recalled row's memory (default 3)")
    ap.add_argument("--agreement", type=int, default=None, metavar="TOKENS",
                    help="instead of timing: print where the draft agrees with the target "
                         "along TOKENS of each prompt's greedy continuation (default prompts: "
                         "eight modules)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.agreement is not None:
        found = agreement(args.prompt or list(AGREEMENT_PROMPTS), args.chars, args.agreement)
        if args.json:
            Path(args.json).write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
        return 0

    import attrs

    from foretell.engine import load
    from foretell.plugin.registry import Kind
    from foretell.spec.verifier import Speculator
    from foretell.tools.measure import machine_info, portable, runtime_info, time_run

    engine = load("demo")
    config = engine.registry.get(Kind.DRAFT, "two-model").config
    draft = engine.use_draft("two-model", config(model="demo-draft"))
    engine.use_draft(None)
    fixed = {k: engine.use_draft("two-model", config(model="demo-draft"), max_tokens=k,
                                 adaptive=False) for k in (3, 4)}
    engine.use_draft(None)

    def run(ids: list[int], speculate: Any) -> dict[str, Any]:
        def steps():
            stats = None
            for event in engine.generate(ids, max_tokens=args.generate, ignore_eos=True,
                                         speculate=speculate):
                if event.type == "text" and event.tokens:
                    yield len(event.tokens)
                elif event.type == "stats":
                    stats = event
            spec = stats.speculation if stats is not None else None
            return {"drafted": spec["drafted"], "accepted": spec["accepted"],
                    "mean_k": spec["mean_k"]} if spec else None

        started = time.perf_counter()
        timing = time_run(steps(), len(ids))
        policy = getattr(speculate, "policy", None)
        # What the policy was told during this run: (drafted, kept, ms, how the time was used).
        told = [(k, kept, round(s * 1e3, 2), use) for k, kept, s, use, at in policy.told
                if at >= started] if policy is not None else None
        got = {"tps": timing.decode_tps, **(timing.extras or {}), "told": told}
        if told is not None:
            got["spent"] = spent(told, args.generate)
        return got

    def paired(name: str, rows: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        """Every row of ``rows`` (name: a speculator, False, or a callable making one per
        request) once per round, order flipping; medians and each row's within-round ratio
        to plain."""
        names = list(rows)

        def once(row: str) -> dict[str, Any]:
            got = run(ids, rows[row]() if callable(rows[row]) else rows[row])
            if isinstance(rows[row], Remembering):
                rows[row].done()
            return got

        for row in names:  # warm-up: shapes, draft weights
            once(row)
        got: dict[str, list[dict[str, Any]]] = {row: [] for row in names}
        for i in range(args.rounds):
            for row in names if i % 2 == 0 else names[::-1]:
                got[row].append(once(row))
            print(f"{name} round {i + 1}: " + ", ".join(
                f"{row} {got[row][-1]['tps']:.1f}" for row in names), file=sys.stderr)
        table = {}
        for row in names:
            tps = [r["tps"] for r in got[row]]
            ratio = [a["tps"] / b["tps"] for a, b in zip(got[row], got["plain"])]
            table[row] = {"median_tps": statistics.median(tps), "tps": tps,
                          "vs_plain_median": statistics.median(ratio), "vs_plain": ratio,
                          "runs": got[row]}
        fixed_rows = [r for r in names if r.startswith("k=")]
        for row in names:
            if fixed_rows and not row.startswith(("k=", "plain")):
                best = [max(got[f][i]["tps"] for f in fixed_rows) for i in range(args.rounds)]
                share = [got[row][i]["tps"] / b for i, b in enumerate(best)]
                table[row]["vs_best_fixed"] = share
                table[row]["vs_best_fixed_median"] = statistics.median(share)
                # The faster fixed row's median: the best of two noisy runs each round
                # favours the fixed rows.
                table[row]["vs_faster_fixed_median"] = table[row]["median_tps"] / max(
                    table[f]["median_tps"] for f in fixed_rows)
            shares = [r["spent"] for r in got[row] if r.get("spent")]
            if shares and not row.startswith(("k=", "plain")):
                table[row]["spent_median"] = {
                    what: statistics.median(s[what] for s in shares) for what in shares[0]}
        if "default-kept" in names:
            # What learning costs, paired: a run over the same round's run of the policy kept
            # across requests (the same rounds, without the warm-up and timings).
            for row in names:
                if row.startswith("default") and row != "default-kept":
                    table[row]["vs_kept_median"] = statistics.median(
                        a["tps"] / b["tps"] for a, b in zip(got[row], got["default-kept"]))
        return table

    fresh = lambda: attrs.evolve(draft)  # noqa: E731 (a new policy, as a new process has)
    # Other processes' load, before and after: on a shared host it moves every row's speed.
    report: dict[str, Any] = {"machine": machine_info(), "runtime": runtime_info(),
                              "generate": args.generate, "rounds": args.rounds,
                              "load_before": os.getloadavg(), "prompts": {}, "cannot_pay": {}}
    prompts = args.prompt or list(PROMPTS)
    remembering = Remembering(draft)
    teach_ids = engine.encode_prompt(read_prompt(TEACH_PROMPT, args.chars))
    for _ in range(args.teach):
        run(teach_ids, remembering())
        remembering.done()
    report["taught_state"] = remembering.state
    first_ids = None
    for spec in prompts:
        text = read_prompt(spec, args.chars)
        ids = engine.encode_prompt(text)
        first_ids = first_ids or ids
        warm = attrs.evolve(draft)
        rows = {"plain": False, "default": fresh, "default-recalled": remembering,
                "default-kept": warm, "k=3": fixed[3], "k=4": fixed[4]}
        report["prompts"][spec] = {"text": text, "tokens": len(ids),
                                   "rows": paired(spec, rows, ids)}

    if not args.skip_cannot_pay:
        self_config = config(model="demo")
        selfish = engine.use_draft("two-model", self_config)
        engine.use_draft(None)
        never = Speculator(kind="never-agrees", provider=NeverAgrees(draft.provider),
                           max_tokens=draft.max_tokens)
        # What the paying runs above stored, recalled by every run of a drafter that
        # cannot pay (never kept: each run starts from the paying state again).
        paying = remembering.state
        report["paying_state"] = paying
        nothing = Speculator(kind="finds-nothing", provider=FindsNothing(), max_tokens=4)
        rows = {"plain": False}
        for name, spec in (("self", selfish), ("never-agrees", never),
                           ("finds-nothing", nothing)):
            rows[name] = lambda spec=spec: attrs.evolve(spec)
            rows[f"{name}-kept"] = spec
            rows[f"{name}-recalled"] = Remembering(spec, paying, keep=False)
        report["cannot_pay"] = paired("cannot pay", rows, first_ids)

    report["load_after"] = os.getloadavg()
    for where, table in [*report["prompts"].items(), ("cannot pay", report["cannot_pay"])]:
        for row, r in (table.get("rows", table) or {}).items():
            share = r.get("vs_best_fixed_median")
            print(f"{where:40s} {row:22s} {r['median_tps']:6.1f} tok/s  "
                  f"x{r['vs_plain_median']:.2f} plain"
                  + (f"  x{share:.2f} best fixed ({min(r['vs_best_fixed']):.2f}-"
                     f"{max(r['vs_best_fixed']):.2f}), x{r['vs_faster_fixed_median']:.2f} "
                     "the faster fixed row's median" if share else "")
                  + (f"  x{r['vs_kept_median']:.2f} kept" if "vs_kept_median" in r else "")
                  + ("  time: warm-up {warmup:.0%}, plain {plain:.0%} ({plain_tokens:.0f} "
                     "tokens), {per_round:.2f} tokens a round after".format(**r["spent_median"])
                     if "spent_median" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(portable(report), indent=1) + "\n",
                                   encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
