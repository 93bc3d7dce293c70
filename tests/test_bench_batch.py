"""foretell bench --batch's worker: every batch size's first timed run follows an untimed
warm-up of that same size, so no timed run pays for shapes new to the process."""

from __future__ import annotations

import json

from foretell.tools.bench_batch import answer_jobs


def test_each_batch_size_is_warmed_up_once_before_its_first_timed_run():
    calls = []

    def run(prompts, max_tokens):
        calls.append((len(prompts), max_tokens))
        return {"decode_tps": float(len(prompts))}

    jobs = [{"prompts": [[1, 2]] * b, "max_tokens": 64} for b in (1, 4, 4, 16)]
    results = list(answer_jobs(run, [json.dumps(job) for job in jobs]))
    assert results == [{"decode_tps": b} for b in (1.0, 4.0, 4.0, 16.0)]
    # The warm-up runs as long as the timed run: a speculating side's probes draft there.
    assert calls == [(1, 64), (1, 64), (4, 64), (4, 64), (4, 64), (16, 64), (16, 64)]
