"""What structured output costs per token with each grammar library that installs from PyPI
here (llguidance, outlines-core): the time to compile a JSON schema for a tokenizer, and the
time per generated token to compute the allowed-token mask and advance the matcher, walking
the tokens of a valid document the way a model would produce them.

    python benchmarks/grammar_mask.py --model demo --repeats 20

It measures, never serves; docs/decisions.md ("Structured output") records what it found.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"],
            "address": {"city": "London", "zip": "12345"}, "active": True}


@functools.lru_cache(maxsize=1)
def _byte_table() -> dict[str, int]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def byte_level_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes (GPT-2's printable-character mapping undone)."""
    table = _byte_table()
    return bytes(table[c] for c in token)


def measure_llguidance(tokenizer_json: str, vocab: int, eos: int, ids: list[int]) -> dict:
    import llguidance
    import numpy as np

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    tokenizer_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, overrides={"whitespace_flexible": False, "item_separator": ", ",
                               "key_separator": ": "})
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    steps = []
    for token in ids:
        start = time.perf_counter()
        mask = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:vocab]
        assert mask[token], lltok.dbg_tokens([token])
        matcher.consume_token(token)
        steps.append(time.perf_counter() - start)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "steps": steps}


def measure_outlines(tokenizer_json: str, vocab: int, eos: int, ids: list[int]) -> dict:
    import numpy as np
    import outlines_core

    tokens = json.loads(tokenizer_json)["model"]["vocab"]
    start = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for text, i in tokens.items():
        if i != eos:
            table.setdefault(byte_level_bytes(text), []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, table)
    tokenizer_s = time.perf_counter() - start
    start = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - start
    guide = outlines_core.Guide(index)
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    steps = []
    for token in ids:
        start = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
        assert allowed[token]
        guide.advance(token, return_tokens=False)
        steps.append(time.perf_counter() - start)
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="a model directory or shipped name")
    parser.add_argument("--repeats", type=int, default=10, help="walks per library")
    args = parser.parse_args()
    from foretell.engine import resolve_model_path
    from foretell.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_dir(path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    eos = min(tokenizer.eos_token_ids)
    ids = tokenizer.encode(json.dumps(DOCUMENT, separators=(", ", ": ")),
                           add_special_tokens=False)
    raw = tokenizer.backend.to_str()
    print(f"{path.name}: vocabulary {vocab}, document {len(ids)} tokens")
    for name, measure in (("llguidance", measure_llguidance), ("outlines-core", measure_outlines)):
        runs = [measure(raw, vocab, eos, ids) for _ in range(args.repeats)]
        per_token = [s for run in runs for s in run["steps"]]
        print(f"{name:14s} tokenizer {statistics.median(r['tokenizer_s'] for r in runs) * 1e3:8.1f} ms"
              f"  compile {statistics.median(r['compile_s'] for r in runs) * 1e3:8.1f} ms"
              f"  mask+advance p50 {statistics.median(per_token) * 1e6:7.1f} us"
              f"  p99 {sorted(per_token)[int(len(per_token) * 0.99)] * 1e6:7.1f} us"
              f"  mean {statistics.fmean(per_token) * 1e6:7.1f} us"
              f"  first {statistics.median(r['steps'][0] for r in runs) * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
