"""``benchmarks/serve_load.py`` against a live ``foretell serve`` on a tiny model: each level
warms the server with an untimed wave of requests, a timed level keeps its clients sending until
its seconds are up, the first wave's worst TTFT is kept apart, each level's TTFT p99 is
reported against c = 1's p50 and p99, and each level's compute floor against c = 1's."""

from __future__ import annotations

import json

import pytest
from benchscript import load

from foretell.tools import make_model_dir

serve_load = load("serve_load")
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    path = make_model_dir(tmp_path_factory.mktemp("tiny"), "qwen3", overrides=TINY, seed=0)
    proc, url = serve_load.start("foretell", path, 4, ["--draft", "none"])
    yield path, url
    proc.terminate()
    proc.wait(timeout=120)


def test_a_warmed_level_counts_only_its_own_requests(served):
    path, url = served
    before = completions_served(url)
    prompts = ["def f(x):", "x = 1", "import os", "class A:"]
    row = asyncio_run(serve_load.level(url, path.name, prompts, 2, 4, 120,
                                       warm=["for i in", "while x:"]))
    assert completions_served(url) - before == len(prompts) + 2  # the warm-up wave was sent
    assert row["requests"] == len(prompts) and row["failed"] == 0  # and not counted
    assert 0 < row["ttft_first_wave_max_s"] <= row["ttft_p99_s"]
    assert 0 < row["ttft_steady_p99_s"] <= row["ttft_p99_s"]  # the two clients' second requests
    # A request's whole time holds its first token and the gaps after it.
    assert row["request_mean_s"] >= row["ttft_p50_s"] * 0.5 + row["itl_mean_s"]
    assert 0 <= row["tail_p50_s"] <= row["tail_p99_s"] < row["request_mean_s"]


def test_a_timed_level_keeps_sending_until_its_seconds_are_up(served):
    path, url = served
    prompts = [f"x = {i}" for i in range(2000)]
    row = asyncio_run(serve_load.level(url, path.name, prompts, 2, 4, 120, seconds=1.5))
    assert row["seconds"] >= 1.5
    assert 2 * 2 < row["requests"] < len(prompts)  # beyond the default count, until the time
    assert not row["prompts_ran_out"]


def test_ttft_ratios_set_each_level_against_c1_p50_and_p99():
    rows = [{"server": "s", "concurrency": 1, "ttft_p50_s": 0.01, "ttft_p99_s": 0.02},
            {"server": "s", "concurrency": 16, "ttft_p50_s": 0.05, "ttft_p99_s": 0.06},
            {"server": "t", "concurrency": 16, "ttft_p50_s": 0.05, "ttft_p99_s": 0.06},
            {"server": "s", "concurrency": 8, "ttft_p50_s": 0.05, "ttft_p99_s": 0.06,
             "ttft_steady_p99_s": 0.03}]
    assert serve_load.ttft_ratios(rows) == [
        {"server": "s", "concurrency": 16, "p99_over_c1_p50": pytest.approx(6.0),
         "p99_over_c1_p99": pytest.approx(3.0)},
        {"server": "s", "concurrency": 8, "p99_over_c1_p50": pytest.approx(6.0),
         "p99_over_c1_p99": pytest.approx(3.0), "steady_p99_over_c1_p50": pytest.approx(3.0)}]


def test_the_report_holds_the_rows_and_ratios(served, tmp_path):
    path, _ = served
    out = tmp_path / "serve.json"
    serve_load.main(["--model", str(path), "--servers", "foretell", "--levels", "1,2",
                     "--prompt-tokens", "16", "--max-tokens", "4", "--floor-repeats", "2",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["rows"]] == [1, 2]
    assert report["warm"] is True
    assert [r["concurrency"] for r in report["ttft_ratios"]] == [2]
    floor = {f["concurrency"]: f for f in report["floor"]}
    assert set(floor) == {1, 2} and floor[1]["over_c1"] == 1.0
    assert floor[2]["seconds"] > 0 and floor[2]["over_c1"] == floor[2]["seconds"] / floor[1][
        "seconds"]


def completions_served(url):
    """``/v1/completions`` requests the server answered, from its ``/metrics``."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("foretell_requests_total") and '"/v1/completions"' in line)


def asyncio_run(coroutine):
    import asyncio

    return asyncio.run(coroutine)


def test_the_compute_floor_runs_on_foretells_blas(tmp_path):
    """The floor is measured in the script's own process: MLX there must bind the optimized
    BLAS as the servers do (imported first, it keeps the reference one, several times
    slower)."""
    import subprocess
    import sys

    path = make_model_dir(tmp_path / "tiny", "qwen3", overrides=TINY, seed=0)
    run = subprocess.run(
        [sys.executable, str(serve_load.__file__), "--servers", "", "--levels", "1",
         "--model", str(path), "--prompt-tokens", "16", "--floor-repeats", "1"],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "floor     c= 1" in run.stdout
    assert "SlowBlasWarning" not in run.stderr


def test_a_level_over_client_processes_sends_every_prompt_once_and_merges_what_they_measured(
        served):
    """``--client-processes``: the clients' own Python is off the measured process; the level
    reads as one (every prompt sent once, each request's figures kept)."""
    path, url = served
    before = completions_served(url)
    prompts = [f"x = {i}" for i in range(9)]
    row = asyncio_run(serve_load.level(url, path.name, prompts, 3, 4, 120, processes=2,
                                       warm=["for i in"]))
    assert completions_served(url) - before == len(prompts) + 1
    assert row["requests"] == len(prompts) and row["failed"] == 0
    assert row["client_processes"] == 2 and row["tokens"] == 4 * len(prompts)
    # The first wave: one request a client, three clients over the two processes.
    assert 0 < row["ttft_first_wave_max_s"] <= row["ttft_p99_s"]
    assert row["server_ttft_mean_s"] > row["server_queue_mean_s"] >= 0


def test_a_spread_level_asks_each_request_for_its_own_length(served):
    """``--max-tokens-spread``: lengths drawn around ``--max-tokens``, the same draws for
    every server (seeded by the level), so clients stop finishing in one wave."""
    path, url = served
    prompts = [f"y = {i}" for i in range(8)]
    rows = [asyncio_run(serve_load.level(url, path.name, prompts, 2, 6, 120, spread=4,
                                         processes=processes)) for processes in (1, 2)]
    draw = __import__("random").Random(2)
    want = sum(6 + draw.randint(-4, 4) for _ in prompts)
    assert [row["tokens"] for row in rows] == [want, want]  # the tiny model never ends early
    assert [row["requests"] for row in rows] == [8, 8]


def test_extra_serve_flags_reach_foretell_serve(monkeypatch):
    started = []

    class Started(Exception):
        pass

    def starting(name, path, tokens, flags):
        started.append((name, flags))
        raise Started

    monkeypatch.setattr(serve_load, "start", starting)
    with pytest.raises(Started):
        serve_load.main(["--servers", "foretell", "--levels", "1",
                         "--serve-arg=--max-rows=16", "--serve-arg=--max-waiting=8"])
    assert started == [("foretell", ["--draft", "none", "--max-rows=16", "--max-waiting=8"])]
