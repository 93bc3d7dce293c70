"""``benchmarks/round_probe.py`` reports, for plain decoding and a drafter at a
fixed length, where each token's or round's time went, then the adaptive policy's figures;
and it leaves ``mx.async_eval`` and the verifier as they were."""

from __future__ import annotations

import re

import mlx.core as mx
from benchscript import load

from foretell.spec import batch

round_probe = load("round_probe")


def test_the_round_probe_reports_host_time_and_the_policys_figures(capsys):
    async_eval, verify_rows = mx.async_eval, batch.verify_rows
    assert round_probe.main(["--prompt-tokens", "24", "--generate", "12", "--repeats", "1",
                             "--requests", "2", "--num-draft-tokens", "2", "--trace", "6",
                             "--gaps", "0", "--plain-steps"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"plain +[\d.]+ tok/s; per token: wall [\d.]+ ms, inside async_eval "
                    r"[\d.]+ ms, waiting 0\.00 ms \(1\.00 tokens\)", out[0])
    assert re.match(r"mtp k=2 +[\d.]+ tok/s; per round: wall [\d.]+ ms, inside async_eval "
                    r"[\d.]+ ms, waiting [\d.]+ ms \([\d.]+ tokens\)", out[1])
    # The policy pinned to k = 0: every round one plain step, so its own loop's cost shows.
    assert re.match(r"mtp k=0 +[\d.]+ tok/s; per round: wall [\d.]+ ms, inside async_eval "
                    r"[\d.]+ ms, waiting [\d.]+ ms \(1\.00 tokens\)", out[2])
    out = out[:2] + out[3:]
    assert out[2].startswith("adaptive request 1") and out[4].startswith("adaptive request 2")
    assert "acceptance by position [" in out[4]
    # Every wait between two tokens is over 0 ms: one per event after the first, at the
    # positions the sequence reached, prompt (24 tokens) included, up to its end.
    positions = [int(p) for p in re.findall(r"(\d+): [\d.]+", out[3])]
    assert out[3].startswith("  waits over 0 ms between tokens (position: ms, 'traced' where a")
    assert positions == sorted(positions) and 25 < positions[0] and positions[-1] == 24 + 12
    # The trace: the first request's first choices (the warm-up drafts the most) and rounds.
    trace = [line.strip() for line in out[6:]]
    assert len(trace) == 6 and trace[0] == "choose 2 (ms per round by k {})"
    assert re.fullmatch(r"drafted [12], kept [0-2]: [\d.]+ ms( \(one-off\))?( \(fed the drafter\))?",
                        trace[1])
    assert mx.async_eval is async_eval and batch.verify_rows is verify_rows


def test_gaps_are_the_waits_between_tokens_by_the_position_the_later_one_reached(monkeypatch):
    """A stall shows where in the sequence it fell: a wait is timed from one event that
    carries tokens to the next, and placed at the position the later one reached (a round's
    burst counts all its tokens), marked when a fixed-shape forward traced meanwhile; waits
    under the threshold and the final flush are not."""
    from foretell.model import fixed
    from foretell.stream import TextEvent

    clock = iter([0.0, 0.050, 0.051, 0.052])
    monkeypatch.setattr(round_probe.time, "perf_counter", lambda: next(clock))
    # A shape traced during the burst's wait (the count read once before and at each event).
    counts = iter([0, 0, 1, 1, 1])
    monkeypatch.setattr(fixed, "trace_count", lambda: next(counts))

    class Engine:
        def generate(self, prompt, **_kw):
            yield TextEvent(text="a", tokens=(1,))
            yield TextEvent(text="b", tokens=(2, 3, 4))  # a burst, 50 ms after
            yield TextEvent(text="c", tokens=(5,))  # 1 ms after
            yield TextEvent(text="", tokens=())  # the flush
            yield TextEvent(text="d", tokens=(6,))  # 1 ms after
            yield type("Stats", (), {"type": "stats"})()

    gaps: list = []
    stats = round_probe._generate(Engine(), list(range(10)), 8, None, gaps, over_ms=10)
    assert stats.type == "stats"
    assert [(at, round(ms), traced) for at, ms, traced in gaps] == [(14, 50, True)]
