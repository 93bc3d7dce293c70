"""``python -m foretell.spec.round_probe`` reports, for plain decoding and a drafter at a
fixed length, where each token's or round's time went, then the adaptive policy's figures;
and it leaves ``mx.async_eval`` and the verifier as they were."""

from __future__ import annotations

import re

import mlx.core as mx

from foretell.spec import round_probe, verifier


def test_the_round_probe_reports_host_time_and_the_policys_figures(capsys):
    async_eval, finish = mx.async_eval, verifier._Verifier.finish
    assert round_probe.main(["--prompt-tokens", "24", "--generate", "12", "--repeats", "1",
                             "--requests", "2", "--num-draft-tokens", "2", "--trace", "6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.match(r"plain +[\d.]+ tok/s; per token: wall [\d.]+ ms, inside async_eval "
                    r"[\d.]+ ms, waiting 0\.00 ms \(1\.00 tokens\)", out[0])
    assert re.match(r"mtp k=2 +[\d.]+ tok/s; per round: wall [\d.]+ ms, inside async_eval "
                    r"[\d.]+ ms, waiting [\d.]+ ms \([\d.]+ tokens\)", out[1])
    assert all(line.startswith("adaptive request ") for line in out[2:4])
    assert "acceptance by position [" in out[3]
    # The trace: the first request's first choices (the warm-up drafts the most) and rounds.
    trace = [line.strip() for line in out[4:]]
    assert len(trace) == 6 and trace[0] == "choose 2 (ms per round by k {})"
    assert re.fullmatch(r"drafted [12], kept [0-2]: [\d.]+ ms( \(one-off\))?", trace[1])
    assert mx.async_eval is async_eval and verifier._Verifier.finish is finish
