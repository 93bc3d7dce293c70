"""What caching the drafter's state buys on a prefix-cache hit, measured (not a test).

    python -m foretell.tools.draft_state_bench [--model demo] [--prompt-tokens 1000]
        [--max-tokens 128] [--repeats 5] [--drafters mtp,two-model] [--json OUT]

For each drafter, one engine and two RAM tiers hold the same prompt: one stores the
drafter's state with the entry (today's behaviour), the other does not (the drafter then
prefills the prompt again; MTP, which reads the target's hidden states over the prompt,
decodes plainly). Hits of the two alternate, so a busy machine slows both alike; each row
is the median of ``--repeats`` hits: time to first token, decode tokens/s, tokens drafted
and ``draft_cached_tokens``. A plain-decoding row over the same hit is the baseline.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
from pathlib import Path
from typing import Any


def _prompt(engine: Any, tokens: int) -> list[int]:
    import json.decoder

    text = Path(inspect.getfile(json.decoder)).read_text(encoding="utf-8")
    ids = engine.encode_prompt(text, chat=False)
    while len(ids) < tokens:
        ids += ids
    return ids[:tokens]


def _hit(engine: Any, prompt: list[int], max_tokens: int, **options: Any) -> dict[str, Any]:
    stats = list(engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True, **options))[-1]
    spec = stats.speculation or {}
    return {"ttft_ms": stats.ttft_s * 1000, "decode_tps": stats.generation_tps,
            "cached_tokens": stats.cached_tokens, "drafted": spec.get("drafted", 0),
            "draft_cached_tokens": spec.get("draft_cached_tokens", 0)}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def measure(model: str, prompt_tokens: int, max_tokens: int, repeats: int,
            drafters: list[str]) -> dict[str, Any]:
    import foretell  # first: on the CPU it binds the fast BLAS before MLX loads

    engine = foretell.load(model)
    import mlx.core as mx

    from foretell.cache.tier import CacheTier
    from foretell.spec.attach import DraftLink

    prompt = _prompt(engine, prompt_tokens)
    usable = DraftLink._usable
    rows: dict[str, Any] = {}
    try:
        for kind in drafters:
            engine.use_draft(kind)
            tiers = {True: CacheTier.for_engine(engine), False: CacheTier.for_engine(engine)}
            runs: dict[bool, list[dict[str, Any]]] = {True: [], False: []}
            for attached in (True, False):
                DraftLink._usable = usable if attached else (lambda self, source: False)
                engine.cache = tiers[attached]
                _hit(engine, prompt, max_tokens)  # cold: stores the prompt's entries
            for _ in range(repeats):
                for attached in (True, False):
                    DraftLink._usable = usable if attached else (lambda self, source: False)
                    engine.cache = tiers[attached]
                    runs[attached].append(_hit(engine, prompt, max_tokens))
            rows[f"{kind}, drafter state cached"] = _median(runs[True])
            rows[f"{kind}, drafter prefills"] = _median(runs[False])
    finally:
        DraftLink._usable = usable
    engine.cache = CacheTier.for_engine(engine)
    _hit(engine, prompt, max_tokens, speculate=False)
    rows["plain decoding"] = _median([_hit(engine, prompt, max_tokens, speculate=False)
                                      for _ in range(repeats)])
    return {"model": model, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "repeats": repeats, "device": str(mx.default_device()),
            "machine": f"{platform.machine()} {platform.system()}", "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--drafters", default="mtp,two-model")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.model, args.prompt_tokens, args.max_tokens, args.repeats,
                     [d for d in args.drafters.split(",") if d])
    print(f"{result['model']}, {result['prompt_tokens']}-token prompt, RAM hit, "
          f"{result['device']} ({result['machine']}), median of {result['repeats']}")
    print(f"{'row':34} {'TTFT ms':>9} {'decode tok/s':>13} {'drafted':>8} {'draft cached':>13}")
    for name, row in result["rows"].items():
        print(f"{name:34} {row['ttft_ms']:9.1f} {row['decode_tps']:13.1f} {row['drafted']:8.0f} "
              f"{row['draft_cached_tokens']:13.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
