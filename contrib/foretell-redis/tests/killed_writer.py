"""A writer that stops at one point of storing an entry and waits to be killed (SIGKILL):
``python killed_writer.py URL STAGE`` prints ``ready`` when it got there. Stages:

- ``mid-upload``: one of the entry's blocks stored, the rest not;
- ``before-publish``: every block stored, the publication not sent;
- ``mid-publish``: half of the publication's bytes sent to the server, the rest never.
"""

from __future__ import annotations

import socket
import sys
import time

from foretell.platform import blas

blas.preload()

import mlx.core as mx  # noqa: E402

from foretell.cache.codecs import StandardKVCodec, snapshot_entry  # noqa: E402
from foretell.model import KVCache  # noqa: E402
from foretell.store.entry import StoreIdentity  # noqa: E402
from foretell_redis.layout import RedisConfig, RedisLayout  # noqa: E402

TOKENS = 40
CODEC = StandardKVCodec()
IDENTITY = StoreIdentity(model_fingerprint="0123456789abcdef", model_id="test/killed",
                         tokenizer_hash="tok-aaaa", codec_providers=[CODEC.provider_id])


def entry():
    cache = KVCache()
    keys = mx.random.normal((1, 4, TOKENS, 64), key=mx.random.key(7))
    cache.update_and_fetch(keys, -keys)
    return snapshot_entry(range(TOKENS), [cache], [CODEC])


def wait_to_be_killed() -> None:
    print("ready", flush=True)
    time.sleep(600)


def main(url: str, stage: str) -> None:
    layout = RedisLayout(url, RedisConfig(block_tokens=8), identity=IDENTITY)
    if stage == "mid-upload":
        upload = layout._upload
        layout._upload = lambda ids, made: (upload(ids[:1], made), wait_to_be_killed())
    elif stage == "before-publish":
        layout._scripts["PUBLISH"] = lambda **_: wait_to_be_killed()
    elif stage == "mid-publish":
        script = layout._scripts["PUBLISH"]

        def half_sent(keys, args):
            packed = layout._client.connection_pool.get_connection().pack_command(
                "EVALSHA", script.sha, len(keys), *keys, *args)
            raw = b"".join(bytes(part) for part in packed)
            pool = layout._client.connection_pool.connection_kwargs
            sock = socket.create_connection((pool["host"], pool["port"]))
            sock.sendall(raw[: len(raw) // 2])
            wait_to_be_killed()

        layout._scripts["PUBLISH"] = half_sent
    else:
        raise SystemExit(f"unknown stage {stage!r}")
    layout.write(entry())
    raise SystemExit("the write finished: the stage was never reached")


if __name__ == "__main__":
    main(*sys.argv[1:])
