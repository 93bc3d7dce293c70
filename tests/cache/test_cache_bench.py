"""The cache benchmark runs end to end (a smoke test of the one command the GPU host runs;
its numbers are not checked: speed lives in benchmarks, never in tests)."""

from __future__ import annotations

from foretell.cache import bench
from foretell.synthetic import make_model_dir


def test_the_cache_bench_runs_every_phase_and_renders_a_row(tmp_path):
    model = make_model_dir(tmp_path / "qwen3", "qwen3")
    report = bench.run_cache_bench([("tiny", model)], prompt_tokens=48, repeats=1,
                                   decode_tokens=4, work_dir=tmp_path)
    (row,) = report["rows"]
    assert row["restore_warm"]["cached_from"] == "ssd"
    assert row["restore_evicted"]["cached_tokens"] == 47
    assert row["prime"]["durable"] and row["prime"]["mlx_lm"]["save_s"] > 0
    assert "| tiny | 48 " in bench.render(report)
