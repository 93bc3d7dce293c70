"""``benchmarks/lone_request.py`` times a lone request four ways (the engine's loop and the
scheduler, plain and drafting), each turn on one prompt, and pairs the ratios turn by turn."""

from __future__ import annotations

import json
import math

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
    ratio = report["ratios"]["scheduler / generate, plain"]
    want = math.exp(sum(math.log(a / b) for a, b in zip(speeds["scheduler plain"],
                                                         speeds["generate plain"])) / 2)
    assert ratio[0] == pytest.approx(want) and ratio[1] <= ratio[0] <= ratio[2]
    assert "drafting / plain, scheduler" in capsys.readouterr().out


def test_a_paired_ratio_is_the_geometric_mean_of_the_turns_ratios():
    mean, low, high = lone_request.paired([2.0, 8.0], [1.0, 2.0])
    assert mean == pytest.approx(math.sqrt(2.0 * 4.0))
    assert low < mean < high
    assert lone_request.paired([1.0], [0.0]) is None  # a way that timed nothing pairs nothing
