"""``benchmarks/lone_request.py`` times a lone request four ways (the engine's loop and the
scheduler, plain and drafting), each turn on one prompt, and pairs the ratios turn by turn."""

from __future__ import annotations

import json
import statistics

import pytest
from benchscript import load

lone_request = load("lone_request")


def test_the_four_ways_are_timed_each_turn_and_their_ratios_paired(tmp_path, capsys):
    out = tmp_path / "lone.json"
    assert lone_request.main(["--draft", "two-model", "--repeats", "2", "--max-tokens", "6",
                              "--prompt-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["tok_s"]) == set(lone_request.WAYS)
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in report["tok_s"].values())
    speeds = report["tok_s"]
    got = report["ratios"]["scheduler / generate, plain"]
    # Paired turn by turn: the median of the two turns' ratios (not a ratio of medians).
    want = statistics.median(a / b for a, b in zip(speeds["scheduler plain"],
                                                   speeds["generate plain"]))
    assert got["ratio"] == pytest.approx(want)
    assert got["ci"][0] <= got["ratio"] <= got["ci"][1]
    assert "drafting / plain, scheduler" in capsys.readouterr().out
