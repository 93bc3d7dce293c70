"""``benchmarks/batch_host_cost.py`` reports both engines' host cost per decode step on the
demo's shape at tiny widths, or a decode step's graph alone, and leaves MLX's eval functions,
the scheduler's idle exit and its own schedulers as they were."""

from __future__ import annotations

import json
import re
import sys

import mlx.core as mx
import pytest
from benchscript import load

import foretell.scheduler as scheduler
from foretell.model import attention

batch_host_cost = load("batch_host_cost")


@pytest.fixture
def fused_attention(monkeypatch):
    # The script picks the attention rule through the environment, which the process caches.
    monkeypatch.setenv("FORETELL_ATTENTION", "fused")
    monkeypatch.setattr(attention, "_MATMUL_MODE", None)


def test_both_engines_host_cost_per_step_is_reported(tmp_path, capsys, fused_attention):
    evals, idle, running = (mx.eval, mx.async_eval), scheduler.IDLE_EXIT_S, set(scheduler._LIVE)
    out = tmp_path / "host.json"
    assert batch_host_cost.main(["--batches", "1,2", "--repeats", "1", "--prompt-tokens", "8",
                                 "--max-tokens", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 2]
    # A saved report is committed: no path of this machine's environment in it.
    assert sys.prefix not in out.read_text()
    for row in rows:
        for side in ("foretell", "mlx-lm"):
            got = row[side]
            assert got["wall"] > 0 and got["host"] > got["eval"] > 0
            assert got["python"] == pytest.approx(got["host"] - got["eval"])
        ours = row["foretell"]
        assert ours["worker"] + ours["readers"] == pytest.approx(ours["python"])
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"B=  2 ms/step  wall +[\d.]+ / +[\d.]+ \([\d.]+x\)  host", lines[-1])
    assert (mx.eval, mx.async_eval) == evals and scheduler.IDLE_EXIT_S == idle
    assert set(scheduler._LIVE) <= running


def test_a_decode_steps_graph_is_timed_and_counted(tmp_path, fused_attention):
    out = tmp_path / "graph.json"
    assert batch_host_cost.main(["--graph", "--batches", "2", "--repeats", "1",
                                 "--prompt-tokens", "8", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    for kind in ("foretell uniform", "foretell ragged", "mlx-lm"):
        assert row[kind]["nodes"] > 0 and row[kind]["host_ms"] > 0
    # Rows of two lengths need a mask and scatter their writes: a few nodes a layer more.
    assert row["foretell uniform"]["nodes"] < row["foretell ragged"]["nodes"]


def test_a_side_per_drafter_reports_its_rows_cost_against_plain(tmp_path, capsys,
                                                                 fused_attention):
    out = tmp_path / "drafts.json"
    assert batch_host_cost.main(["--batches", "2", "--repeats", "1", "--prompt-tokens", "8",
                                 "--max-tokens", "4", "--sides", "foretell",
                                 "--drafts", "two-model,mtp", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    row = got["rows"][0]
    assert got["drafts"] == ["two-model", "mtp"]
    for side in ("foretell", "foretell two-model", "foretell mtp"):
        figures = row[side]
        assert figures["host"] > figures["eval"] > 0 and figures["worker"] > 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"B=  2 mtp ms/step  wall .*\(foretell mtp / foretell\)$", lines[-1])
