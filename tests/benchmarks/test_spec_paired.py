"""``benchmarks/spec_paired.py``: ``--fixed-shapes-ab`` runs every row with fixed-shape
verify forwards forced on and off in turns, each against the plain row of its own mode;
``--new-lengths`` gives every round a prompt length no earlier run had; the sampled row runs
what a user's sampled request gets, and the acceptance rules meet at a fixed length."""

from __future__ import annotations

import statistics

from benchscript import load

from foretell.model import fixed
from foretell.tools import bench_spec as bench

foretell_only = load("spec_paired").foretell_only


def test_fixed_shapes_ab_runs_each_row_in_both_modes(monkeypatch):
    ran = []
    real = fixed.FixedForward.__call__

    def counted(self, *arrays, caches, length):
        ran.append(fixed._MODE)
        return real(self, *arrays, caches=caches, length=length)

    monkeypatch.setattr(fixed.FixedForward, "__call__", counted)
    monkeypatch.setattr(fixed, "_MODE", "off")
    report = foretell_only("demo", ["plain", "mtp"], prompt_tokens=24, max_tokens=6, repeats=1,
                           draft_model="demo-draft", num_draft_tokens=2, adaptive=False,
                           fixed_shapes_ab=True)
    rows = {r["row"]: r for r in report["rows"]}
    assert set(rows) == {"plain@fixed-on", "plain@fixed-off", "mtp@fixed-on", "mtp@fixed-off"}
    assert rows["plain@fixed-on"]["vs_plain"] == 1.0 and rows["mtp@fixed-off"]["vs_plain"] > 0
    assert ran and set(ran) == {"on"}  # fixed forwards ran, and only in the "on" turns
    assert fixed._MODE == "off"  # the process's own setting is back


def test_new_lengths_gives_each_round_a_prompt_one_token_shorter(monkeypatch):
    lengths = []
    real = bench.foretell_runner

    def runner(row):
        run = real(row)

        def recorded(engine, prompt, max_tokens, job):
            lengths.append((row, len(prompt)))
            return run(engine, prompt, max_tokens, job)

        return recorded

    monkeypatch.setattr(bench, "foretell_runner", runner)
    report = foretell_only("demo", ["plain", "two-model"], prompt_tokens=24, max_tokens=4,
                           repeats=2, draft_model="demo-draft", num_draft_tokens=2,
                           new_lengths=True)
    assert report["new_lengths"] is True
    full = lengths[0][1]
    # warm-ups on the whole prompt, then both rows one token shorter per round
    assert [n for _row, n in lengths] == [full, full, full - 1, full - 1, full - 2, full - 2]


def _speculators_by_temperature(monkeypatch) -> dict:
    """Temperature -> the speculators the bench's foretell runs used, in order (a fresh set
    of speculators for the test)."""
    used: dict = {}
    real = bench._foretell

    def recorded(engine, prompt, max_tokens, speculate, temp=0.0):
        used.setdefault(temp, []).append(speculate)
        return real(engine, prompt, max_tokens, speculate, temp)

    monkeypatch.setattr(bench, "_foretell", recorded)
    monkeypatch.setattr(bench, "_SPECULATORS", {})
    return used


def test_the_sampled_row_runs_the_adaptive_length_and_the_rules_meet_at_a_fixed_one(monkeypatch):
    used = _speculators_by_temperature(monkeypatch)
    rows = ["two-model", "two-model-t0.8", "two-model-t0.8-fixed", "two-model-t0.8-match"]
    foretell_only("demo", rows, prompt_tokens=24, max_tokens=4, repeats=1,
                  draft_model="demo-draft", num_draft_tokens=2)
    # every row's warm-up in order, then its timed run
    greedy, sampled = used[0.0][:1], used[bench.SAMPLED][:3]
    assert used[0.0][1] is greedy[0] and used[bench.SAMPLED][3:] == sampled
    assert [(s.adaptive, s.acceptance) for s in greedy + sampled] == [
        (True, "rejection"), (True, "rejection"), (False, "rejection"), (False, "token-match")]
    assert greedy[0] is not sampled[0]  # one policy per sampling regime


def test_the_sampled_mtp_row_drafts_with_the_head_at_temperature(monkeypatch):
    """``mtp-t0.8`` is what a sampled request gets by default on a GPU: the MTP head with
    rejection sampling and the adaptive length, its policy apart from the greedy row's."""
    used = _speculators_by_temperature(monkeypatch)
    report = foretell_only("demo", ["plain-t0.8", "mtp", "mtp-t0.8"], prompt_tokens=24,
                           max_tokens=4, repeats=1, draft_model="demo-draft",
                           num_draft_tokens=2)
    sampled = [s for s in used[bench.SAMPLED] if s]
    greedy = [s for s in used[0.0] if s]
    assert sampled and greedy and sampled[0] is not greedy[0]
    assert (sampled[0].kind, sampled[0].adaptive, sampled[0].acceptance) == (
        "mtp", True, "rejection")
    rows = {r["row"]: r for r in report["rows"]}
    assert bench.plain_row("mtp-t0.8") == "plain-t0.8" and rows["mtp-t0.8"]["vs_plain"] > 0


def test_a_row_says_what_its_policy_went_by_and_each_round(monkeypatch):
    """A speculative row's JSON carries the policy's typical round time per draft length
    (0: a plain step) and its acceptance estimates, and every round's paired ratio and
    mean k, so a run whose drafting went wrong shows why."""
    monkeypatch.setattr(bench, "_SPECULATORS", {})
    report = foretell_only("demo", ["plain", "mtp"], prompt_tokens=24, max_tokens=24,
                           repeats=2, draft_model="demo-draft", num_draft_tokens=2)
    row = {r["row"]: r for r in report["rows"]}["mtp"]
    extras = row["extras"]
    assert extras["policy_round_ms"] and all(t > 0 for t in extras["policy_round_ms"].values())
    (speculator,) = bench._SPECULATORS.values()
    assert len(extras["policy_acceptance"]) == speculator.max_tokens
    assert extras["policy_acceptance"] == speculator.policy.acceptance()
    # What the policy was told during the last run, as it was told it: plain stretches
    # (k = 0) and rounds; the first run's observations are not the last run's.
    told, heard = extras["policy_told"], list(speculator.policy.told)
    assert told and len(told) < len(heard)
    assert [(o["k"], o["kept"], o["use"]) for o in told] == [
        (k, kept, use) for k, kept, _s, use, _at in heard[-len(told):]]
    assert {o["use"] for o in told} <= {"timed", "untimed", "first"}
    assert told[-1]["ago_ms"] == 0 and all(a["ago_ms"] >= b["ago_ms"] for a, b in zip(told, told[1:]))
    assert len(row["vs_plain_paired_runs"]) == len(row["mean_k_runs"]) == 2
    assert row["vs_plain_paired_median"] == statistics.median(row["vs_plain_paired_runs"])
