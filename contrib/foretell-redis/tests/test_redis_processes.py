"""Processes sharing one server: a second ``foretell run`` reuses the prefix the first one
computed (``--cache-dir redis://...``) with output identical to a cold run; ``foretell cache``
lists, counts, verifies and clears what the server holds; a writer killed with SIGKILL at
any point of storing an entry leaves nothing served half-written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("redis", reason="the redis client is not installed (pip install "
                                    "./contrib/foretell-redis brings it)")

from foretell.cli import main  # noqa: E402
from foretell.tools import make_model_dir  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1]
#: Long enough to fill two of the layout's default blocks (256 tokens each).
PROMPT = " ".join(f"word{i % 97} item{i % 13}" for i in range(400))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("redis-processes") / "qwen3", "qwen3")


def foretell_run(model_dir, *extra) -> tuple[str, dict]:
    """``foretell run`` in a process of its own: the text it generated and its stats."""
    done = subprocess.run(
        [sys.executable, "-m", "foretell", "run", "--model", str(model_dir), "--prompt", PROMPT,
         "--max-tokens", "8", "--json", *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FORETELL_SPILL_DUTY": "1"})
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return "".join(line.get("text", "") for line in lines[:-1]), lines[-1]


def test_a_second_process_reuses_the_first_processs_prefix(redis_installed, redis_url,
                                                           model_dir):
    cold_text, cold = foretell_run(model_dir)
    first_text, first = foretell_run(model_dir, "--cache-dir", redis_url)
    second_text, second = foretell_run(model_dir, "--cache-dir", redis_url)
    assert first["cached_tokens"] == 0 and cold["prompt_tokens"] > 512
    assert second["cached_from"] == "ssd"
    assert second["cached_tokens"] == second["prompt_tokens"] - 1
    assert cold_text == first_text == second_text


def test_cache_commands_list_count_verify_and_clear_what_the_server_holds(
        redis_installed, redis_url, model_dir, capsys):
    foretell_run(model_dir, "--cache-dir", redis_url)

    def cache_json(action):
        code = main(["cache", action, "--cache-dir", redis_url, "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, listing = cache_json("ls")
    assert code == 0 and {r["layout"] for r in listing["entries"]} == {"redis"}
    stored = len(listing["entries"])
    assert stored >= 1
    code, stats = cache_json("stats")
    assert code == 0 and stats["entries"] == stored and stats["cache_dir"] == redis_url
    assert cache_json("verify") == (0, {"verified": stored, "bad": [], "skipped": []})
    code, cleared = cache_json("clear")
    assert code == 0 and cleared["removed"] == stored and cleared["freed_bytes"] > 0
    assert cache_json("ls")[1]["entries"] == []


@pytest.mark.parametrize("stage", ["mid-upload", "before-publish", "mid-publish"])
def test_a_writer_killed_while_storing_leaves_nothing_served(redis_url, shared_server, stage):
    from foretell_redis.layout import RedisConfig, RedisLayout

    writer = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("killed_writer.py")), redis_url, stage],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(SOURCE), *filter(None, [os.environ.get("PYTHONPATH")])])})
    try:
        line = writer.stdout.readline()
        assert line.strip() == "ready", writer.stderr.read()
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    from killed_writer import IDENTITY, TOKENS

    client = shared_server.client()
    reader = RedisLayout(redis_url, RedisConfig(block_tokens=8), identity=IDENTITY)
    key = reader.key_for(range(TOKENS))
    assert reader.scan() == [] and reader.read(key) is None
    assert reader.prefixes([*range(TOKENS), 1], "", beyond=0) == []
    stored = len(list(client.scan_iter(match="foretell:*:b:*")))
    assert stored == (1 if stage == "mid-upload" else 5)
    assert reader.collect() == 0  # within the grace: the writer might still publish them
    eager = RedisLayout(redis_url, RedisConfig(block_tokens=8, collect_grace_s=0),
                        identity=IDENTITY)
    assert eager.collect() > 0 and list(client.scan_iter(match="foretell:*:b:*")) == []
