"""The cache benchmark runs end to end (a smoke test of the one command the GPU host runs;
its numbers are not checked: speed lives in benchmarks, never in tests)."""

from __future__ import annotations

import statistics

import pytest

from foretell.errors import BenchError
from foretell.tools import bench_cache, bench_cache_phases, make_model_dir


@pytest.mark.parametrize("layout", [None, "single-file"])
def test_the_cache_bench_runs_every_phase_over_a_layout_and_renders_a_row(tmp_path, layout):
    model = make_model_dir(tmp_path / "qwen3", "qwen3")
    report = bench_cache.run_cache_bench([("tiny", model)], prompt_tokens=48, repeats=1,
                                         decode_tokens=4, layout=layout, work_dir=tmp_path)
    ran = layout or "blocks"  # without --layout: the tier's default
    assert report["layout"] == ran
    (row,) = report["rows"]
    prime, warm, evicted = row["prime"], row["restore_warm"], row["restore_evicted"]
    assert row["layout"] == prime["layout"] == warm["layout"] == ran
    assert warm["cached_from"] == "ssd"
    assert evicted["cached_tokens"] == 47 and evicted["evicted"]
    assert prime["durable"] and prime["mlx_lm"]["save_s"] > 0
    # RAM hits once the entry was written (what a writer's reads cost the next step).
    assert len(prime["ram_hits_after_write_ttft_s"]) == 2
    assert all(t > 0 for t in prime["ram_hits_after_write_ttft_s"])
    # The restore read the entry the dd rows read: the same key, the same bytes.
    assert warm["read_keys"] == [prime["entry_key"]]
    assert warm["read_bytes"] == prime["entry_bytes"] == row["dd_warm"]["runs"][0]["bytes"]
    # The tier's lookup holds the read; the same prompt right after is a RAM hit.
    assert warm["lookup_s"] >= warm["read_s"] > 0 and warm["ram_hit_after_ttft_s"] > 0
    files = prime["entry_files"]
    if ran == "blocks":  # a manifest and its blocks; the store's account of the read
        assert list(warm["read_steps_ms"]) == [
            "manifest", "buffers", "queued", "blocks", "digests", "arrays"]
        assert 0 < sum(warm["read_steps_ms"].values()) <= warm["read_s"] * 1e3
        assert files[0].endswith(".safetensors") and len(files) >= 2
        assert all(f.endswith(".blk") for f in files[1:])
    else:
        assert len(files) == 1 and warm["read_steps_ms"] is None
    assert row["dd_evicted"]["files"] == len(files)
    # An entry of several files also gets dd over one file of the same bytes.
    assert ("dd_warm_one_file" in row) == (len(files) > 1)
    assert prime["reads"]["verified_s"] > 0 and prime["reads"]["unverified_s"] > 0
    decode = prime["decode"]
    assert decode["entries_written_per_run"][0] >= 1
    # The writer's cost: each writing round over the idle round beside it, then the median.
    runs = decode["runs"]
    assert decode["paired_ratios"] == [w / i for i, w in zip(runs["idle"], runs["writing"])]
    assert decode["ratio"] == statistics.median(decode["paired_ratios"])
    assert decode["write_s"] > 0 and decode["remove_s"] > 0
    interleaved = decode["interleaved"]  # within one decode: the steps writes ran through
    assert interleaved["writes"] >= 1
    assert sum(interleaved[f"{s}_steps"] for s in ("writing", "removing", "idle", "edge")
               ) <= 8 * 4 - 1
    table = bench_cache.render(report)
    assert f"in one decode {interleaved['ratio']:.2f}×" in table
    assert f"| tiny | {ran} | 48 " in table
    # Cold over SSD restore, warm and evicted, as the TTFTs give them (never rounded to 0×).
    cold = prime["cold_ttft_s"]
    shown = [bench_cache._times(cold / warm["ttft_s"]), bench_cache._times(cold / evicted["ttft_s"])]
    assert f"| **{shown[0]} / {shown[1]}** |" in table


def test_a_speed_up_below_ten_keeps_two_decimals():
    assert [bench_cache._times(r) for r in (0.24, 1.0, 9.994, 10.4, 133.6)] == [
        "0.24×", "1.00×", "9.99×", "10×", "134×"]


def test_the_reserve_ab_restores_with_the_reserve_and_without_taking_turns(tmp_path):
    """``--reserve-ab``: each fresh-process restore runs with the restore reserve (the
    default: filled as the tier opens, the restore's buffers carved from it) and with it off,
    and the table shows both."""
    model = make_model_dir(tmp_path / "qwen3", "qwen3")
    report = bench_cache.run_cache_bench([("tiny", model)], prompt_tokens=48, repeats=2,
                                         decode_tokens=4, work_dir=tmp_path, reserve_ab=True)
    (row,) = report["rows"]
    for kind in ("warm", "evicted"):
        on, off = row[f"restore_{kind}"]["runs"], row[f"restore_{kind}_no_reserve"]["runs"]
        assert len(on) == len(off) == 2
        assert all(r["reserve_served"] and r["reserve_open_fill_s"] > 0 for r in on)
        assert all(r["reserve"]["fills"] == 2 for r in on)  # refilled after the request
        assert all(not r["reserve_served"] and r["reserve"] is None for r in off)
        assert all(r["cached_from"] == "ssd" for r in on + off)
    table = bench_cache.render(report)
    assert "| tiny | on (4 of 4 restores served) |" in table
    assert "| tiny | off (0 of 4 restores served) |" in table


def test_an_unknown_layout_is_refused_naming_the_option_and_the_installed_ones(tmp_path):
    with pytest.raises(BenchError, match=r"--layout nope: .*installed: .*blocks.*single-file"):
        bench_cache.run_cache_bench([("tiny", tmp_path)], prompt_tokens=8, repeats=1,
                                    decode_tokens=1, layout="nope", work_dir=tmp_path)


def test_steps_count_as_writing_only_when_a_write_ran_all_through_them():
    """Writes ran over [1, 2] and [3, 4], their copies were deleted over [2, 2.4] and
    [4, 4.2]: a step inside a write is "writing", one inside a deletion "removing", one
    touching neither "idle", and one a write or a deletion began or ended in an "edge"."""
    steps = [(0.0, 0.5, 1), (0.5, 1.0, 1),     # idle (touching the span's start is not in it)
             (1.1, 1.5, 2), (1.5, 2.0, 2),     # writing: 4 tokens over 0.9 s
             (2.0, 2.3, 1),                    # removing
             (2.5, 3.5, 1),                    # a write began in it: an edge
             (3.2, 3.4, 1),                    # writing
             (3.9, 4.1, 1), (4.1, 4.3, 3)]     # edges: a write ended, a deletion ended
    speeds = bench_cache_phases.steady_speeds(steps, {"writing": [(1.0, 2.0), (3.0, 4.0)],
                                                      "removing": [(2.0, 2.4), (4.0, 4.2)]})
    assert [speeds[f"{s}_steps"] for s in ("writing", "removing", "idle", "edge")] == [3, 1, 2, 3]
    assert speeds["writing_tps"] == pytest.approx(5 / 1.1)
    assert speeds["idle_tps"] == pytest.approx(2 / 1.0)
    assert speeds["removing_tps"] == pytest.approx(1 / 0.3)
    assert speeds["edge_tps"] == pytest.approx(5 / 1.4)
    assert speeds["ratio"] == speeds["writing_ratio"] == pytest.approx((5 / 1.1) / 2.0)
    assert speeds["removing_ratio"] == pytest.approx((1 / 0.3) / 2.0)
    assert speeds["edge_ratio"] == pytest.approx((5 / 1.4) / 2.0)
    # Each phase's slowest step: a one-off stall shows apart from a steady cost.
    assert [speeds[f"{s}_slowest_s"] for s in ("writing", "removing", "idle", "edge")
            ] == pytest.approx([0.5, 0.3, 0.5, 1.0])


def test_the_interleaved_decode_first_runs_as_long_without_a_writer(tmp_path, monkeypatch):
    """A step only the first decode of a length pays (a GPU's kernel for a longer cache)
    must not land in a phase: a decode of the same length runs before the writer starts."""
    calls = []

    class Engine:
        def generate(self, prompt, max_tokens, ignore_eos):
            calls.append((max_tokens, writer_started[0]))
            yield from ()

    writer_started = [False]

    def interleaved_steps(engine, factory, entry, prompt, scratch, tokens):
        writer_started[0] = True
        return [(0.0, 0.1, 1)], {"writing": [], "removing": []}

    monkeypatch.setattr(bench_cache_phases, "_generate", lambda engine, prompt, max_tokens=1: list(
        engine.generate(prompt, max_tokens=max_tokens, ignore_eos=True)))
    monkeypatch.setattr(bench_cache_phases, "interleaved_steps", interleaved_steps)
    out = bench_cache_phases._decode_beside_interleaved_writes(Engine(), None, None, [1, 2], tmp_path, 96)
    assert calls == [(96, False)] and writer_started[0]
    assert out["idle_steps"] == 1 and out["writes"] == 0


def test_the_never_dry_writer_is_the_spill_worker_itself(tmp_path):
    """The decode-under-writes row measures what the spill worker costs: its writes run on
    the worker's own thread (so at its priority and pace), each into a fresh directory that
    is then deleted, until the decode is over; each write and each deletion is timed."""
    import threading
    import time

    from foretell.tools.bench_cache_phases import _write_until

    threads, roots = [], []

    class Layout:
        def __init__(self, root):
            self.root = root

        def write(self, entry):
            threads.append(threading.current_thread().name)
            roots.append(self.root)
            self.root.mkdir()
            return True

    class Entry:
        tensor_bytes = 8

    stop, count, spans = threading.Event(), [0], {"writing": [], "removing": []}
    writer = threading.Thread(target=_write_until, args=(Layout, tmp_path, Entry(), stop, count),
                              kwargs={"spans": spans})
    writer.start()
    deadline = time.monotonic() + 5
    while count[0] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    writer.join(5)
    assert not writer.is_alive() and count[0] == len(roots) >= 2
    assert set(threads) == {"foretell-spill"} and len(set(roots)) == len(roots)
    assert list(tmp_path.iterdir()) == []
    # Each write's span, then its copy's deletion's, starting where the write ended.
    assert len(spans["writing"]) == len(spans["removing"]) == count[0]
    for (start, end), (gone, done) in zip(spans["writing"], spans["removing"]):
        assert start <= end == gone <= done


def test_the_decode_rows_writer_writes_the_entry_as_the_tier_hands_it_over(tmp_path, codecs):
    """The writer beside the decode writes what the spill worker would be given (the tier's
    ``for_writer``: evaluated, bfloat16 contiguous, digests where recorded), not the raw
    snapshot, whose strided views the writer thread would run MLX ops on."""
    import argparse
    import types

    import mlx.core as mx
    from cachefill import filled_kv

    prepared, written = [], []

    class Tier:
        def __init__(self):
            self.codecs = codecs

        def for_writer(self, entry):
            prepared.append(entry)
            return entry

    class Layout:
        def __init__(self, root):
            self.root = root

        def write(self, entry):
            written.append(entry)
            return True

    class Engine:
        def generate(self, prompt, max_tokens, ignore_eos):
            for _ in range(max_tokens):
                yield types.SimpleNamespace(type="text", tokens=(1,), generation_tps=1.0)

    donor = types.SimpleNamespace(tokens=tuple(range(20)),
                                  caches=[filled_kv(20, dtype=mx.bfloat16)])
    args = argparse.Namespace(repeats=1, decode_tokens=2)
    bench_cache_phases._decode_under_writes(Engine(), Tier(), Layout, donor, tmp_path, args)
    assert len(prepared) == 1 and written
    assert all(entry is prepared[0] for entry in written)


def test_a_new_length_prefill_runs_prompt_lengths_the_process_has_not_run(tmp_path, monkeypatch):
    """The GPU's cold row at a new length: each run a prompt one token shorter than the
    last, the median of their times to first token, and the table shows it beside the cold
    prefill."""
    lengths, ttfts = [], iter([0.3, 0.1, 0.2])

    class Stats:
        def __init__(self):
            self.ttft_s = next(ttfts)

    def generate(engine, prompt, max_tokens=1):
        lengths.append(len(prompt))
        return Stats()

    monkeypatch.setattr(bench_cache_phases, "_generate", generate)
    assert bench_cache_phases._new_length_prefills(None, list(range(100)), 3) == 0.2
    assert lengths == [99, 98, 97]
    assert bench_cache._new_length_cell({"cold_new_length_ttft_s": 0.2}) == " (0.200 s at a new length)"
    assert bench_cache._new_length_cell({}) == ""


def test_kv_bits_runs_every_phase_on_quantized_kv_and_says_so(tmp_path):
    """``--kv-bits 8``: the model runs with 8-bit KV in every phase, so the stored entry and
    mlx-lm's file hold the quantized KV (here under half the float32 KV's bytes), the restore
    serves it, and the table names the scheme."""
    model = make_model_dir(tmp_path / "qwen3", "qwen3", overrides={  # head_dim: 64-wide groups
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    runs = {bits: bench_cache.run_cache_bench([("tiny", model)], prompt_tokens=48, repeats=1,
                                              decode_tokens=4, work_dir=tmp_path, kv_bits=bits)
            for bits in (None, 8)}
    (plain,), (quantized,) = runs[None]["rows"], runs[8]["rows"]
    assert quantized["kv_bits"] == 8 and plain["kv_bits"] is None
    assert quantized["restore_warm"]["cached_from"] == "ssd"
    assert quantized["restore_evicted"]["cached_tokens"] == 47
    stored = {name: row["prime"]["entry_bytes"] for name, row in (("plain", plain), ("q", quantized))}
    assert stored["q"] < stored["plain"] / 2
    lm = {name: row["prime"]["mlx_lm"]["bytes"] for name, row in (("plain", plain), ("q", quantized))}
    assert lm["q"] < lm["plain"] / 2
    assert "| tiny, KV 8-bit | blocks | 48 " in bench_cache.render(runs[8])
    assert "| tiny | blocks | 48 " in bench_cache.render(runs[None])
