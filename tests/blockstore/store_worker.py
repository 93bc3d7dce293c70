"""A second process on a block-store directory, driven by the tests over stdin/stdout.

    python store_worker.py ops ROOT BLOCK_TOKENS      one JSON op per line -> one JSON reply
    python store_worker.py killer ROOT BLOCK_TOKENS   "go SEED DELAY_MS" -> fork a writer,
                                                      SIGKILL it after DELAY_MS -> "killed"

Entries are built from numpy (rows are a pure function of the tokens, see ``rows``), so a
forked writer never runs MLX: the fork is safe, and every process builds identical bytes
for identical tokens.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import numpy as np

HEADS, DIM, LAYERS = 2, 8, 2
PREFIXES = [list(range(100, 160)), list(range(200, 260)), [7] * 60]


def rows(tokens, layer: int) -> np.ndarray:
    """``[1, HEADS, len(tokens), DIM]`` float32; row t depends only on tokens[t] and t."""
    t = np.asarray(tokens, dtype=np.float32)[:, None]
    pos = np.arange(len(tokens), dtype=np.float32)[:, None]
    row = np.sin(t * 0.37 + pos * 0.11 + layer + np.arange(DIM, dtype=np.float32) * 0.5)
    return np.stack([row, -row])[None].astype(np.float32)


def tokens_of(prefix: int, length: int) -> list[int]:
    return PREFIXES[prefix][:length]


def entry(tokens):
    from foretell.store.entry import Entry, LayerState

    layers = [LayerState(codec="kv", provider="foretell.baseline/kv@1",
                         meta={"offset": len(tokens)},
                         tensors={"keys": rows(tokens, i), "values": rows(tokens, i) * 2})
              for i in range(LAYERS)]
    return Entry(tokens=tokens, layers=layers)


def open_layout(root: str, block_tokens: int):
    from foretell.store.entry import StoreIdentity
    from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

    identity = StoreIdentity(model_fingerprint="0123456789abcdef", model_id="test/tiny",
                             tokenizer_hash="tok-aaaa",
                             codec_providers=["foretell.baseline/kv@1"])
    return BlockStoreLayout(root, BlockStoreConfig(block_tokens=block_tokens),
                            identity=identity)


def serve_ops(root: str, block_tokens: int) -> None:
    layout = open_layout(root, block_tokens)
    for line in sys.stdin:
        op = json.loads(line)
        if op["op"] == "root":
            layout = open_layout(op["root"], block_tokens)
            result = None
        elif op["op"] == "write":
            result = layout.write(entry(tokens_of(op["prefix"], op["length"])))
        elif op["op"] == "remove":
            result = layout.remove(layout.key_for(tokens_of(op["prefix"], op["length"])))
        elif op["op"] == "collect":
            result = layout.collect()
        elif op["op"] == "collect-loop":  # until told to stop: races the caller's writes
            rounds = 0
            while not os.path.exists(op["until"]):
                layout.collect()
                rounds += 1
            result = rounds
        else:
            raise ValueError(f"unknown op {op!r}")
        print(json.dumps({"result": result}), flush=True)


def write_forever(root: str, block_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    layout = open_layout(root, block_tokens)
    written = []
    while True:
        tokens = tokens_of(rng.randrange(len(PREFIXES)), rng.randint(1, 40))
        if rng.random() < 0.3:
            tokens = tokens + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 9))]
        layout.write(entry(tokens))
        written.append(tokens)
        if rng.random() < 0.3:
            layout.remove(layout.key_for(rng.choice(written)))


def serve_kills(root: str, block_tokens: int) -> None:
    # Imported (never run) before forking, so a child starts writing at once.
    import mlx.core  # noqa: F401

    import foretell.store.entry  # noqa: F401
    import foretell_blockstore.layout  # noqa: F401

    for line in sys.stdin:
        _go, seed, delay_ms = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(root, block_tokens, int(seed))
            finally:
                os._exit(1)
        time.sleep(float(delay_ms) / 1000)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        print("killed", flush=True)


if __name__ == "__main__":
    mode, root, block_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    {"ops": serve_ops, "killer": serve_kills}[mode](root, block_tokens)
