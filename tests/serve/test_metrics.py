"""The latency histograms of ``GET /metrics``: Prometheus' cumulative buckets."""

from __future__ import annotations

from foretell.serve.metrics import LATENCY_BUCKETS, Histogram, Metrics
from foretell.stream import Stats


def test_a_histogram_counts_each_observation_under_every_bound_it_is_within():
    histogram = Histogram()
    for seconds in (0.004, 0.005, 0.02, 0.3, 99.0):
        histogram.observe(seconds)
    lines = dict(line.rsplit(" ", 1) for line in histogram.lines("t"))
    assert lines['t_bucket{le="0.005"}'] == "2"  # a bound holds what equals it
    assert lines['t_bucket{le="0.025"}'] == "3"
    assert lines['t_bucket{le="0.25"}'] == "3" and lines['t_bucket{le="0.5"}'] == "4"
    assert lines[f't_bucket{{le="{LATENCY_BUCKETS[-1]!r}"}}'] == "4"
    assert lines['t_bucket{le="+Inf"}'] == lines["t_count"] == "5"
    assert float(lines["t_sum"]) == 0.004 + 0.005 + 0.02 + 0.3 + 99.0


def test_time_to_first_token_counts_the_wait_for_admission():
    metrics = Metrics()
    metrics.finished(Stats(prompt_tokens=3, generated_tokens=2, cached_tokens=0, ttft_s=0.02,
                           prompt_tps=1.0, generation_tps=1.0, peak_memory_gb=0.0,
                           finish_reason="length", queued_s=0.2))
    assert metrics.ttft.sum == 0.22 and metrics.queued.sum == 0.2
    assert metrics.ttft.counts[LATENCY_BUCKETS.index(0.25)] == 1
