"""``benchmarks/first_shapes.py`` times each row count's plain steps and shared prefills twice
over, then ragged prompts, and puts the scheduler's methods back exactly as they were."""

from __future__ import annotations

import json

from benchscript import load

from foretell.scheduler import Scheduler

first_shapes = load("first_shapes")


def test_each_row_count_is_met_twice_then_ragged_prompts(tmp_path, capsys):
    methods = (Scheduler._plain_step, Scheduler._prefill_together)
    own = {name for name in ("_plain_step", "_prefill_together") if name in vars(Scheduler)}
    out = tmp_path / "shapes.json"
    assert first_shapes.main(["--rows", "3", "--prompt-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["sweep"], r["rows"]) for r in report["sweeps"]] == [
        (s, b) for s in range(2) for b in (1, 2, 3)]
    # Every row count took plain steps over all its rows; several prompts at once into an
    # idle batch prefill together.
    assert all(r["plain_step_max_ms"] > 0 for r in report["sweeps"])
    assert all(r["shared_prefill_ms"] for r in report["sweeps"] if r["rows"] > 1)
    assert [(r["sweep"], r["rows"]) for r in report["ragged"]] == [
        (s, b) for s in range(3) for b in (4, 8, 16)]
    assert "slowest plain step" in capsys.readouterr().out
    assert (Scheduler._plain_step, Scheduler._prefill_together) == methods
    # Inherited methods are not left set on Scheduler (a later patch of its base would miss).
    assert {name for name in ("_plain_step", "_prefill_together") if name in vars(Scheduler)} == own


def test_a_summary_takes_the_slowest_step_over_all_the_rows_only():
    record = [("plain_step", 2, 9.0), ("plain_step", 3, 4.0), ("plain_step", 3, 5.0),
              ("shared_prefill", 0, 7.0)]
    got = first_shapes.summary(record, 3, 20.0)
    assert got == {"rows": 3, "wall_ms": 20.0, "plain_step_max_ms": 5.0,
                   "shared_prefill_ms": [7.0]}
