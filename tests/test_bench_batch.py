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


def test_the_bench_says_which_batch_size_it_is_warming_before_its_figures(monkeypatch):
    """Each batch size is announced before its sides run (a fresh GPU host compiles kernels
    for minutes during the warm-up: silence would read as a hang), then its row."""
    from foretell.tools import bench_batch

    order = []

    class Side:
        def __init__(self, argv):
            self.name = argv[1]

        def run(self, job):
            order.append(("run", len(job["prompts"])))
            return {"decode_tps": 1.0, "total_tps": 1.0, "ttft_p50_s": 0.0,
                    "ttft_p99_s": 0.0, "tokens": 1.0}

        def close(self):
            pass

    monkeypatch.setattr(bench_batch, "_Side", Side)
    monkeypatch.setattr(bench_batch, "prompts_for", lambda model, b, n, seed: [[1]] * b)
    bench_batch.run_batch_bench(
        "model", batches=[1, 4], prompt_tokens=8, max_tokens=4, repeats=1, drafts=[None],
        draft_model=None, k=4, float32_mlx_lm=False,
        progress=lambda line: order.append(("said", line.split("|")[0].strip(),
                                            "warming" in line)))
    assert order == [("said", "B=  1", True), ("run", 1), ("run", 1), ("said", "B=  1", False),
                     ("said", "B=  4", True), ("run", 4), ("run", 4), ("said", "B=  4", False)]


def test_each_turn_starts_one_side_later(monkeypatch):
    """The sides' order rotates a turn at a time: no side always runs after the same one,
    and every turn still runs each side once on the same prompts."""
    from foretell.tools import bench_batch

    ran = []

    class Side:
        def __init__(self, argv):
            self.name = argv[argv.index("--draft") + 1] if "--draft" in argv else argv[1]

        def run(self, job):
            ran.append((self.name, job["prompts"][0][0]))
            return {"decode_tps": 1.0, "total_tps": 1.0, "ttft_p50_s": 0.0,
                    "ttft_p99_s": 0.0, "tokens": 1.0}

        def close(self):
            pass

    monkeypatch.setattr(bench_batch, "_Side", Side)
    monkeypatch.setattr(bench_batch, "prompts_for", lambda model, b, n, seed: [[seed]] * b)
    bench_batch.run_batch_bench(
        "model", batches=[1], prompt_tokens=8, max_tokens=4, repeats=4,
        drafts=[None, "mtp"], draft_model=None, k=4, float32_mlx_lm=False,
        progress=lambda line: None)
    turns = [ran[i:i + 3] for i in range(0, len(ran), 3)]
    assert [[name for name, _ in turn] for turn in turns] == [
        ["mlx-lm", "foretell", "mtp"], ["foretell", "mtp", "mlx-lm"],
        ["mtp", "mlx-lm", "foretell"], ["mlx-lm", "foretell", "mtp"]]
    assert all(len({seed for _, seed in turn}) == 1 for turn in turns)


def test_a_speculating_side_sets_its_drafter_as_a_user_does_warm_up_included(
        tmp_path, monkeypatch):
    """The side's drafter comes from ``Engine.use_draft``, which warms every draft length
    where the device compiles kernels per shape (``make_speculator`` alone skips that, and
    a GPU's timed runs paid the compiles)."""
    from foretell.spec import warmup
    from foretell.tools import make_model_dir
    from foretell.tools.bench_batch import _foretell_side

    tiny_model = make_model_dir(tmp_path / "target", "qwen3", seed=0, overrides={
        "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128})
    warmed = []
    monkeypatch.setattr(warmup, "compiles_per_shape", lambda: True)
    real = warmup.warm_up
    monkeypatch.setattr(warmup, "warm_up", lambda engine, speculator, progress=None: (
        warmed.append(speculator.max_tokens), real(engine, speculator, progress))[1])
    draft = make_model_dir(tmp_path / "draft", "qwen3", seed=1, overrides={
        "hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64})
    run = _foretell_side(str(tiny_model), "two-model", str(draft), 3)
    assert warmed == [3]
    assert run([[5, 6, 7, 5, 6, 7, 5, 6]], 4)["tokens"] == 4


def test_ratios_pair_the_sides_of_each_turn():
    """A host whose speed drifts between turns moves both sides of a turn alike: the
    ratio is the median of each turn's ratios, not the ratio of the medians (here 2.0)."""
    from foretell.tools.bench_batch import paired_ratios, render_row

    def side(*tps):
        return [{"decode_tps": float(t)} for t in tps]

    runs = {"mlx-lm": side(100, 200, 400), "foretell plain": side(110, 400, 440),
            "foretell two-model": side(121, 440, 396)}
    paired = paired_ratios(runs)
    assert paired["foretell plain"]["x_mlx_lm"] == 1.1
    assert round(paired["foretell two-model"]["x_mlx_lm"], 6) == 1.21
    assert round(paired["foretell two-model"]["x_plain"], 6) == 1.1
    # Each with its interval from the same turns' ratios (as the single-request bench's).
    low, high = paired["foretell plain"]["x_mlx_lm_ci"]
    assert low < 1.1 < 2.0 < high
    cell = {"decode_tps": 1.0, "ttft_p50_s": 0.0, "ttft_p99_s": 0.0}
    row = {"batch": 4, "paired": paired, **{name: cell for name in runs}}
    line = render_row(row, list(runs))
    assert f"foretell plain:     1.0 tok/s (1.10x [{low:.2f}-{high:.2f}])," in line
    assert ", 1.10x [" in line and "] plain)" in line
    one_turn = paired_ratios({name: got[:1] for name, got in runs.items()})
    assert one_turn["foretell plain"]["x_mlx_lm_ci"] is None
    assert "(1.10x)," in render_row({**row, "paired": one_turn}, list(runs))
