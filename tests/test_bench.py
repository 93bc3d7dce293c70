"""``foretell bench`` end to end on a tiny model, and the clock it uses for both sides."""

from __future__ import annotations

import json
import math
import statistics
import sys

import pytest

from foretell.cli import main as cli_main
from foretell.tools import bench, make_model_dir, measure


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("bench") / "tiny-qwen3", "qwen3")


def test_bench_compares_both_sides_on_the_same_request(tiny_model, tmp_path, capsys):
    out = tmp_path / "report.json"
    code = cli_main(
        ["bench", "--model", str(tiny_model), "--prompt-tokens", "12", "--generate", "6",
         "--repeats", "1", "--json", str(out)]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert set(report["machine"]) >= {"date", "cpu", "cores", "gpu", "os", "load_avg_1m"}
    (model,) = report["models"]
    assert model["model"] == "tiny-qwen3"
    assert model["prompt_tokens"] == 12 and model["generated_tokens"] == 6
    assert model["interleaved"] is True
    row = model["rows"][0]
    assert row["scenario"] == "greedy" and row["baseline"] == "mlx-lm"
    for side in ("foretell", "mlx_lm"):
        # EOS is ignored on both sides, so each generated exactly what was asked.
        assert row[side]["generated"] == 6
        assert len(row[side]["runs"]) == 1
        (timed,) = row[side]["runs"]
        # both sides clocked alike: the prompt over the time to the first token
        assert timed["prefill_tps"] == pytest.approx(12 / timed["ttft_s"])
        assert row[side]["decode_tps"] == timed["decode_tps"]  # the median of one run
    assert row["prefill_ratio"] == pytest.approx(
        row["foretell"]["prefill_tps"] / row["mlx_lm"]["prefill_tps"]
    )
    assert row["decode_ratio"] == pytest.approx(
        row["foretell"]["decode_tps"] / row["mlx_lm"]["decode_tps"]
    )
    assert row["acceptance"] is None
    assert row["decode_ratio_ci95"] is None  # one round: no interval
    runtime = model["runtime"]
    assert runtime["mlx-lm"]["blas_status"]["reason"] == "FORETELL_BLAS=reference"
    assert runtime["foretell"]["mlx"] == runtime["mlx-lm"]["mlx"]
    assert runtime["foretell"]["backend"] in ("cpu", "cuda", "metal")
    if sys.platform.startswith("linux"):
        assert runtime["foretell"]["blas_status"]["loaded"]
    table = capsys.readouterr().out
    assert "tiny-qwen3" in table and "greedy" in table
    assert f"{row['decode_ratio']:.2f}x" in table


def test_without_a_model_it_measures_the_shipped_default(monkeypatch, capsys):
    from foretell.engine import DEFAULT_MODEL, resolve_model_path

    class Measured(Exception):
        pass

    def run_bench(models, **_options):
        raise Measured(models)

    monkeypatch.setattr(bench, "run_bench", run_bench)
    with pytest.raises(Measured) as measured:
        cli_main(["bench", "--repeats", "1"])
    assert measured.value.args[0] == [(DEFAULT_MODEL, resolve_model_path(None))]
    assert f"the shipped {DEFAULT_MODEL!r}" in capsys.readouterr().err


def test_a_side_that_fails_is_one_error_naming_it(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64}))
    assert cli_main(["bench", "--model", str(broken), "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    assert "the foretell side failed" in err and str(broken) in err


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (None, "config.json: not found; a model directory needs a config.json"),
        ("[1, 2]", "config.json: cannot be read"),
        ('{"model_type": "qwen3"}', "config.json: field 'vocab_size' must be a positive integer"),
    ],
)
def test_a_directory_that_is_not_a_model_is_one_error_naming_its_config(
    config, says, tmp_path, capsys
):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    assert cli_main(["bench", "--model", str(tmp_path), "--repeats", "1"]) == 1
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("foretell: error: ") and says in line and "Traceback" not in err


@pytest.mark.parametrize(
    "flag", ["--prompt-tokens", "--generate", "--repeats", "--num-draft-tokens"]
)
def test_a_count_below_one_is_refused_naming_its_flag(flag, capsys):
    assert cli_main(["bench", "--synthetic", "30m", flag, "0"]) == 1
    assert capsys.readouterr().err == f"foretell: error: {flag} must be >= 1\n"


def test_a_models_dir_that_cannot_be_written_is_one_error_naming_it(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_main(["bench", "--synthetic", "30m", "--models-dir", str(blocker)]) == 1
    err = capsys.readouterr().err
    assert f"foretell: error: --models-dir {blocker}: " in err and "Traceback" not in err


def test_a_json_file_that_cannot_be_written_is_one_error_naming_it(tiny_model, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "report.json"
    argv = ["bench", "--model", str(tiny_model), "--prompt-tokens", "2", "--generate", "1",
            "--repeats", "1", "--json", str(target)]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert f"foretell: error: --json {target}: " in err and "Traceback" not in err


def test_layout_without_cache_is_refused_naming_both_flags(tiny_model, capsys):
    assert cli_main(["bench", "--model", str(tiny_model), "--layout", "blocks"]) == 1
    assert "--layout picks the storage layout of --cache; add --cache" in capsys.readouterr().err


def test_reserve_ab_without_cache_is_refused_naming_both_flags(tiny_model, capsys):
    assert cli_main(["bench", "--model", str(tiny_model), "--reserve-ab"]) == 1
    assert "--reserve-ab compares restores of --cache; add --cache" in capsys.readouterr().err


def test_kv_bits_without_cache_is_refused_naming_both_flags(tiny_model, capsys):
    assert cli_main(["bench", "--model", str(tiny_model), "--kv-bits", "8"]) == 1
    assert "--kv-bits quantizes the KV of --cache's runs; add --cache" in capsys.readouterr().err


def test_an_unknown_cache_layout_is_refused_with_the_installed_ones(tiny_model, capsys):
    assert cli_main(["bench", "--cache", "--model", str(tiny_model), "--layout", "nope"]) == 1
    err = capsys.readouterr().err
    assert "--layout nope:" in err and "blocks" in err and "single-file" in err


def test_bits_without_synthetic_is_refused_naming_both_flags(tiny_model, capsys):
    assert cli_main(["bench", "--model", str(tiny_model), "--bits", "4"]) == 1
    assert "--bits quantizes the weights of --synthetic models; add --synthetic" in \
        capsys.readouterr().err


def test_a_quantized_synthetic_model_is_its_own_directory_stored_as_mlx_lm_stores_it(tmp_path):
    from safetensors import safe_open

    from foretell.tools import measure

    packed = measure.synthetic_model("30m", "float32", tmp_path, bits=4)
    assert packed.name.endswith("-float32-q4-seed0")
    config = json.loads((packed / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    (weights,) = packed.glob("*.safetensors")
    with safe_open(str(weights), "np") as f:
        names = set(f.keys())
    assert any(n.endswith(".scales") for n in names) and any(n.endswith(".biases") for n in names)
    assert measure.synthetic_model("30m", "float32", tmp_path, bits=4) == packed  # made once


def test_unknown_synthetic_shape_is_refused_with_the_known_ones(capsys):
    assert cli_main(["bench", "--synthetic", "7b"]) == 1
    err = capsys.readouterr().err
    assert "--synthetic 7b: unknown shape" in err and "30m" in err


def test_clock_counts_prompt_over_first_token_and_the_rest_over_the_remaining_time(monkeypatch):
    ticks = iter([0.0, 2.0, 6.0])  # start, first step, end
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(ticks))

    def steps():
        yield 1
        yield 3
        yield 2
        return {"acceptance": 0.5}

    timing = measure.time_run(steps(), prompt_tokens=100)
    assert timing.ttft_s == 2.0
    assert timing.prefill_tps == 50.0
    assert timing.generated == 6
    assert timing.decode_tps == 5 / 4.0
    assert timing.extras == {"acceptance": 0.5}


def test_timed_runs_alternate_between_the_sides_and_flip_order_each_round():
    class FakeSide:
        def __init__(self, side):
            self.side = side

        def run(self, scenario, drop=0):
            calls.append(self.side)
            drops.append(drop)
            return measure.Timing(prefill_tps=1.0, decode_tps=2.0, ttft_s=0.1, generated=3)

        def peak_memory_gb(self):
            return 0.5

    calls, drops = [], []
    sides = {s: FakeSide(s) for s in bench.SIDES}
    summary = bench._measure(sides, "greedy", repeats=3)
    a, b = bench.SIDES
    # warm-ups first, then A B, B A, A B
    assert calls == [a, b, a, b, b, a, a, b]
    assert drops == [0] * 8  # every run the whole prompt
    for side in bench.SIDES:
        assert len(summary[side]["runs"]) == 3
        assert summary[side]["decode_tps"] == 2.0 and summary[side]["peak_memory_gb"] == 0.5
    # --new-lengths: the warm-ups run the whole prompt, round i both sides one shorter by i + 1
    calls.clear(), drops.clear()
    bench._measure(sides, "greedy", repeats=3, new_lengths=True)
    assert calls == [a, b, a, b, b, a, a, b]
    assert drops == [0, 0, 1, 1, 2, 2, 3, 3]
    # a later scenario in the same processes continues the count: no length comes back
    calls.clear(), drops.clear()
    bench._measure(sides, "two-model", repeats=3, new_lengths=True, earlier=3)
    assert drops == [0, 0, 4, 4, 5, 5, 6, 6]


def test_a_speculation_row_pairs_each_round_with_a_plain_run_beside_it():
    speeds = {"mtp": iter([30.0, 60.0, 90.0, 10.0]), "plain": iter([20.0, 20.0, 40.0, 90.0])}

    class FakeSide:
        def __init__(self, side):
            self.side = side

        def run(self, scenario, drop=0):
            calls.append((self.side, scenario, drop))
            decode = next(speeds[scenario]) if self.side == "foretell" else 5.0
            return measure.Timing(prefill_tps=1.0, decode_tps=decode, ttft_s=0.1, generated=3)

        def peak_memory_gb(self):
            return 0.5

    calls = []
    sides = {s: FakeSide(s) for s in bench.SIDES}
    summary = bench._measure(sides, "mtp", repeats=3, new_lengths=True, paired_plain="plain")
    a, b = bench.SIDES
    assert a == "foretell"
    # warm-ups (foretell's plain row too), then each round's plain run beside foretell's
    # timed one at the same prompt length, before it and after it in turn; mlx-lm never
    assert calls == [(a, "plain", 0), (a, "mtp", 0), (b, "mtp", 0),
                     (a, "plain", 1), (a, "mtp", 1), (b, "mtp", 1),
                     (b, "mtp", 2), (a, "mtp", 2), (a, "plain", 2),
                     (a, "plain", 3), (a, "mtp", 3), (b, "mtp", 3)]
    ours = summary["foretell"]
    assert [r["decode_tps"] for r in ours["runs"]] == [60.0, 90.0, 10.0]
    assert [r["decode_tps"] for r in ours["plain_runs"]] == [20.0, 40.0, 90.0]
    assert "plain_runs" not in summary["mlx-lm"]
    # paired: median of 3.0, 2.25, 0.11; row against row: 60 / 40 = 1.5
    assert bench._vs_plain_paired(ours) == 2.25
    # In one run the paired plain row is warmed up once: a later row pairing with it (or
    # the plain row's own scenario before) leaves it out of that row's warm-ups.
    speeds.update(mtp=iter([30.0] * 4), plain=iter([20.0] * 8))
    warmed: set[str] = set()
    bench._measure(sides, "plain", repeats=1, warmed=warmed)
    calls.clear()
    bench._measure(sides, "mtp", repeats=1, paired_plain="plain", warmed=warmed)
    assert calls == [(a, "mtp", 0), (b, "mtp", 0), (a, "plain", 0), (a, "mtp", 0),
                     (b, "mtp", 0)]
    assert warmed == {"plain", "mtp"}
    assert bench._paired_plain("mtp") == "plain" and bench._paired_plain("plain") is None
    assert bench._paired_plain("ngram-edit") == "plain-edit"
    assert bench._paired_plain("greedy") is None


def test_cold_mlx_lm_runs_each_timed_run_in_a_fresh_process_warmed_on_a_short_prompt():
    class FakeSide:
        made = 0

        def __init__(self, side):
            self.side, self.closed = side, False
            FakeSide.made += 1
            self.number = FakeSide.made

        def run(self, scenario, drop=0):
            calls.append((self.side, self.number, drop))
            return measure.Timing(prefill_tps=1.0, decode_tps=float(self.number), ttft_s=0.1,
                                generated=3)

        def peak_memory_gb(self):
            return 0.25 * self.number

        def close(self):
            self.closed = True
            closed.append(self.number)

    calls, closed = [], []
    sides = {s: FakeSide(s) for s in bench.SIDES}  # processes 1 and 2, long-lived
    a, b = bench.SIDES
    summary = bench._measure(sides, "two-model", repeats=2, new_lengths=True,
                             fresh={b: lambda: FakeSide(b)}, warm_drop=90)
    # foretell warms up and runs in its own process; mlx-lm's long-lived process (2) sits
    # the row out; each of its timed runs is a new process: a warm-up on the prompt less
    # its first 90 tokens, then the timed run, then the process closes
    assert calls == [(a, 1, 0), (a, 1, 1), (b, 3, 90), (b, 3, 1),
                     (b, 4, 90), (b, 4, 2), (a, 1, 2)]
    assert closed == [3, 4] and not sides[b].closed
    assert [r["decode_tps"] for r in summary[b]["runs"]] == [3.0, 4.0]
    assert summary[b]["peak_memory_gb"] == 1.0  # the last fresh process's
    assert bench._mlx_lm_speculates("two-model-t0.8-match") and bench._mlx_lm_speculates("self")
    assert not bench._mlx_lm_speculates("mtp") and not bench._mlx_lm_speculates("greedy")


def test_new_lengths_runs_shorter_prompts_on_both_sides(tiny_model, tmp_path):
    out = tmp_path / "new.json"
    assert cli_main(["bench", "--model", str(tiny_model), "--prompt-tokens", "8", "--generate",
                     "4", "--repeats", "2", "--new-lengths", "--json", str(out)]) == 0
    (model,) = json.loads(out.read_text())["models"]
    assert model["new_lengths"] is True
    row = model["rows"][0]
    assert len(row["foretell"]["runs"]) == len(row["mlx_lm"]["runs"]) == 2


def test_sequential_mode_reports_the_same_shape(tiny_model, tmp_path):
    out = tmp_path / "seq.json"
    code = cli_main(
        ["bench", "--model", str(tiny_model), "--prompt-tokens", "8", "--generate", "4",
         "--repeats", "2", "--sequential", "--json", str(out)]
    )
    assert code == 0
    (model,) = json.loads(out.read_text())["models"]
    assert model["interleaved"] is False
    row = model["rows"][0]
    assert row["decode_ratio_ci95"] is None  # rounds do not pair up
    assert len(row["foretell"]["runs"]) == len(row["mlx_lm"]["runs"]) == 2
    assert row["foretell"]["generated"] == row["mlx_lm"]["generated"] == 4


def test_paired_ratio_interval_comes_from_the_rounds_and_widens_with_their_spread():
    def runs(values):
        return [{"decode_tps": v} for v in values]

    # foretell exactly 1.1x mlx-lm in every round, whatever the machine did: no spread
    steady = measure.paired_ratio_ci(runs([110, 55, 220]), runs([100, 50, 200]), "decode_tps")
    assert steady == pytest.approx([1.1, 1.1])
    # the ratios 1.2 and 0.8: geometric, t with 1 degree of freedom
    lo, hi = measure.paired_ratio_ci(runs([120, 80]), runs([100, 100]), "decode_tps")
    logs = [math.log(1.2), math.log(0.8)]
    half = 12.71 * statistics.stdev(logs) / math.sqrt(2)
    assert lo == pytest.approx(math.exp(statistics.fmean(logs) - half))
    assert hi == pytest.approx(math.exp(statistics.fmean(logs) + half))
    assert lo < 1.0 < hi
    assert measure.paired_ratio_ci(runs([1]), runs([1]), "decode_tps") is None


@pytest.fixture(scope="module")
def cpu_report(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-cpu") / "report.json"
    code = cli_main(
        ["bench", "--model", str(tiny_model), "--prompt-tokens", "8", "--generate", "4",
         "--repeats", "2", "--json", str(out)]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_on_the_cpu_mlx_lm_also_runs_on_foretells_openblas(cpu_report):
    (model,) = cpu_report["models"]
    runtime = model["runtime"]
    if runtime["foretell"]["backend"] != "cpu" or not runtime["foretell"]["blas_status"]["loaded"]:
        pytest.skip("the same-BLAS row exists where foretell runs on the CPU with OpenBLAS")
    as_installed, same_blas = model["rows"]
    assert (as_installed["baseline"], same_blas["baseline"]) == ("mlx-lm", bench.SAME_BLAS)
    # what users get: mlx-lm on MLX's reference BLAS; the engine's own gain: the same OpenBLAS
    assert runtime["mlx-lm"]["blas_status"]["loaded"] is None
    assert runtime[bench.SAME_BLAS]["blas_status"]["loaded"] == (
        runtime["foretell"]["blas_status"]["loaded"]
    )
    assert same_blas["foretell"] == as_installed["foretell"]  # one foretell side, two baselines
    assert same_blas["decode_ratio"] == pytest.approx(
        same_blas["foretell"]["decode_tps"] / same_blas["mlx_lm"]["decode_tps"]
    )
    assert len(same_blas["mlx_lm"]["runs"]) == 2


def test_the_table_labels_which_blas_each_mlx_lm_row_ran_on(cpu_report):
    table = bench.render(cpu_report)
    assert "mlx-lm on" in table
    if len(cpu_report["models"][0]["rows"]) == 2:
        assert "its BLAS" in table and "OpenBLAS" in table and f"{bench.SAME_BLAS}:" in table


def test_json_without_a_file_prints_the_report_on_stdout(tiny_model, capsys):
    code = cli_main(["bench", "--model", str(tiny_model), "--prompt-tokens", "8",
                     "--generate", "3", "--repeats", "1", "--json"])
    assert code == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["models"][0]["rows"][0]["foretell"]["generated"] == 3
    assert "round 1/1: decode tok/s foretell" in captured.err  # progress per round


def test_without_mlx_lm_the_error_names_the_extra_to_install(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlx_lm" else real(name, *a)
    )
    assert cli_main(["bench", "--synthetic", "30m"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "mlx-lm, which is not installed" in err and "pip install '.[bench]'" in err


def test_saved_reports_carry_no_machine_local_paths(tmp_path):
    import site
    import tempfile
    from pathlib import Path

    import foretell

    package = Path(foretell.__file__).resolve().parent
    lib = Path(site.getsitepackages()[0]) / "cmeel.prefix" / "lib" / "libopenblas.so.0"
    report = {"path": str(package / "demo" / "demo"),
              "runtime": [{"blas": f"OpenBLAS ZEN, 1 thread(s): {lib}"}],
              "scratch": str(Path(tempfile.gettempdir()) / "foretell-bench-x"),
              "cache": str(Path.home() / ".cache" / "foretell"), "n": 3}
    assert measure.portable(report) == {
        "path": "<site-packages>/foretell/demo/demo",
        "runtime": [{"blas": "OpenBLAS ZEN, 1 thread(s): <site-packages>/cmeel.prefix/lib/libopenblas.so.0"}],
        "scratch": "<tmp>/foretell-bench-x",
        "cache": "~/.cache/foretell", "n": 3}


def test_new_lengths_never_repeat_a_length_across_scenarios_in_one_process(tiny_model,
                                                                            monkeypatch):
    """Each scenario's timed rounds continue the previous scenario's count: a GPU keeps its
    kernel plans per shape, so a later row's round meeting an earlier row's prompt length
    would get that row's plans for free (measured on the H200 for mlx-lm's self-drafting)."""
    drops: dict[str, list[int]] = {}

    class FakeSide:
        def __init__(self, side, job, scratch):
            self.side, self.load_s = side, 0.0
            self.runtime = {"backend": "cuda", "blas_status": {"loaded": None}}

        def run(self, scenario, drop=0):
            drops.setdefault(self.side, []).append(drop)
            return measure.Timing(prefill_tps=1.0, decode_tps=2.0, ttft_s=0.1, generated=3)

        def peak_memory_gb(self):
            return 0.5

        def close(self):
            pass

    monkeypatch.setattr(bench, "SideProcess", FakeSide)
    bench.compare(tiny_model, label="tiny", prompt_tokens=8, max_tokens=4, repeats=2,
                  scenarios=("greedy", "greedy"), new_lengths=True)
    for side in bench.SIDES:
        timed = [d for d in drops[side] if d]
        assert timed == [1, 2, 3, 4], drops  # warm-ups whole, then every round a new length


def test_on_a_gpu_the_blas_line_says_it_is_not_used(monkeypatch):
    """The CPU's BLAS does no work when MLX runs on a GPU: the report says so instead of the
    CPU's import-order story (the H200's reports read "mlx was imported before foretell")."""
    import mlx.core as mx

    assert "not used" not in measure.runtime_info()["blas"]  # the CPU: the BLAS it bound
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert measure.runtime_info()["blas"] == "not used: the matmuls run on the GPU (cuda)"


def test_a_target_without_a_head_skips_the_mtp_rows(tmp_path):
    import json
    import shutil

    from foretell.engine import resolve_model_path
    from foretell.tools import bench_spec

    target = tmp_path / "no-head"
    shutil.copytree(resolve_model_path("demo"), target)
    config = json.loads((target / "config.json").read_text())
    del config["mtp_config"]
    (target / "config.json").write_text(json.dumps(config))
    rows = ["plain", "mtp", "mtp-t0.8", "plain-t0.8"]
    assert bench_spec.runnable(target, rows, None) == ["plain", "plain-t0.8"]
    assert bench_spec.runnable(resolve_model_path("demo"), rows, None) == rows
