"""``benchmarks/batch_policy_trace.py`` records every width the batch policy chose and every
step it timed for speculating rows, its drafters taking turns in a rotating order, and puts
the policy back as it was."""

from __future__ import annotations

import json

from benchscript import load

from foretell.spec import batch_policy

batch_policy_trace = load("batch_policy_trace")


def test_the_policys_choices_and_timings_are_recorded(tmp_path, capsys):
    choose, observe = batch_policy.BatchDraftPolicy.choose, batch_policy.BatchDraftPolicy.observe
    out = tmp_path / "trace.json"
    assert batch_policy_trace.main(["--drafts", "none,two-model", "--batches", "2",
                                    "--repeats", "2", "--prompt-tokens", "8",
                                    "--max-tokens", "6", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())
    # Each turn starts one drafter later, so the host's drift falls on both alike.
    assert list(runs) == ["none B=2 #0", "two-model B=2 #0", "two-model B=2 #1", "none B=2 #1"]
    assert all(run["step_ms_median"] > 0 and run["gc_ms"] >= 0 for run in runs.values())
    # Plain rows never ask for widths (their steps are still timed for the policy).
    assert not [s for s in runs["none B=2 #0"]["trace"] if s[0] == "choose"]
    steps = runs["two-model B=2 #0"]["trace"]
    chosen = [s for s in steps if s[0] == "choose"]
    assert chosen and all(rows == 2 and width >= 0 for _, rows, width, _ in chosen)
    assert any(s[0] == "observe" for s in steps)
    assert "two-model B=2" in capsys.readouterr().out
    assert (batch_policy.BatchDraftPolicy.choose, batch_policy.BatchDraftPolicy.observe) == (
        choose, observe)
