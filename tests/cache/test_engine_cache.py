"""The engine with a cache tier: a repeated prompt computes only its last token, a fresh
process restores from disk, and continuing from a restored prefix is token-identical to
the RAM hit and to the original run (Qwen3, and Gemma 3 after its window wrapped); chat
turns reuse the previous turn; quantized KV matches mlx-lm's quantized-KV generation;
an interrupted generation resumes identically (greedy and seeded sampling)."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest

import foretell
from foretell.cache.tier import CacheTier
from foretell.config import SamplingConfig
from foretell.errors import ConfigError
from foretell.tools import make_model_dir

PROMPT = list(range(5, 45))  # 40 tokens: wraps Gemma's 8-token window
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text"])
def model_dir(request, tmp_path_factory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def engine_over(model_dir, cache_dir, **options):
    engine = foretell.load(model_dir, **options)
    engine.cache = CacheTier.for_engine(engine, cache_dir)
    return engine


def run(engine, prompt=PROMPT, **options):
    events = list(engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **options))
    tokens = [t for e in events[:-1] for t in e.tokens]
    return tokens, events[-1]


def test_a_repeated_prompt_computes_only_its_last_token_and_says_so(model_dir, tmp_path):
    engine = engine_over(model_dir, None)
    first, cold = run(engine)
    again, warm = run(engine)
    assert (cold.cached_tokens, cold.cached_from) == (0, None)
    assert (warm.cached_tokens, warm.cached_from) == (len(PROMPT) - 1, "ram")
    assert again == first
    assert warm.to_dict()["cached_from"] == "ram"


def test_an_engine_given_a_directory_opens_its_tier_there(model_dir, tmp_path):
    """`load(..., cache=DIR)`: the tier `CacheTier.for_engine` opens, without importing it."""
    writer = foretell.load(model_dir, cache=str(tmp_path))
    assert isinstance(writer.cache, CacheTier) and writer.cache.ssd is not None
    run(writer)
    assert writer.cache.close(10).durable
    _, stats = run(foretell.load(model_dir, cache=tmp_path))  # a path-like too
    assert (stats.cached_from, stats.cached_tokens) == ("ssd", len(PROMPT) - 1)


def test_a_cache_directory_that_is_a_file_is_refused_by_name(model_dir, tmp_path):
    """As ``--cache-dir`` is: a path naming a file is a mistake, not a full disk."""
    path = tmp_path / "kv"
    path.write_text("")
    with pytest.raises(ConfigError, match=f"{path} is a file, not a directory"):
        foretell.load(model_dir, cache=path)


def test_a_script_that_exits_without_flushing_keeps_what_it_computed(model_dir, tmp_path):
    """The writer is a daemon thread: the interpreter's exit waits (bounded) for its queued
    writes, so an integrator's script that generates and returns leaves its entries."""
    import subprocess
    import sys

    script = ("import sys, foretell\n"
              "engine = foretell.load(sys.argv[1], cache=sys.argv[2])\n"
              f"list(engine.generate({PROMPT!r}, max_tokens=4, ignore_eos=True))\n")
    subprocess.run([sys.executable, "-c", script, str(model_dir), str(tmp_path)], check=True,
                   timeout=120)
    _, stats = run(foretell.load(model_dir, cache=tmp_path))
    assert (stats.cached_from, stats.cached_tokens) == ("ssd", len(PROMPT) - 1)


def test_a_forked_child_leaves_the_parents_tiers_to_the_parent(model_dir, tmp_path):
    """The child has the tier but not its writer thread; the parent closes it."""
    import os
    import warnings

    from foretell.cache import tier as tier_module

    engine = foretell.load(model_dir, cache=tmp_path)
    assert engine.cache in tier_module._OPEN_TIERS
    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12+: forking a threaded process (the child only
        warnings.simplefilter("ignore", DeprecationWarning)  # writes a byte and exits)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        os.write(write, b"%d" % len(tier_module._OPEN_TIERS))
        os._exit(0)
    os.close(write)
    assert os.read(read, 16) == b"0"
    os.waitpid(child, 0)
    assert engine.cache in tier_module._OPEN_TIERS
    engine.cache.close(10)


def test_restore_in_a_fresh_process_continues_token_identically(model_dir, tmp_path):
    original, _ = run(foretell.load(model_dir))
    writer = engine_over(model_dir, tmp_path)
    assert run(writer)[0] == original
    ram_hit, ram = run(writer)
    assert writer.cache.close(10).durable
    restored, ssd = run(engine_over(model_dir, tmp_path))
    assert ram.cached_from == "ram" and ssd.cached_from == "ssd"
    assert ssd.cached_tokens == len(PROMPT) - 1
    assert restored == ram_hit == original


def test_a_longer_prompt_reuses_the_stored_prefix(model_dir, tmp_path):
    engine = engine_over(model_dir, tmp_path)
    run(engine)
    longer = [*PROMPT, 7, 8, 9]
    tokens, stats = run(engine, longer)
    assert stats.cached_tokens >= len(PROMPT) - 1
    assert tokens == run(foretell.load(model_dir), longer)[0]


def test_the_next_chat_turn_reuses_the_previous_turn(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    engine = engine_over(model_dir, None)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    events = list(engine.generate(messages, max_tokens=8))
    reply = "".join(e.text for e in events[:-1] if e.type == "text")
    first = events[-1]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    second = list(engine.generate(messages, max_tokens=8))[-1]
    assert second.cached_tokens >= first.prompt_tokens
    assert second.cached_tokens < second.prompt_tokens


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_kv_greedy_output_matches_mlx_lm(tmp_path, bits):
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model_dir = make_model_dir(tmp_path / "m", "qwen3", overrides={
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    ours, _ = run(foretell.load(model_dir, kv_bits=bits))
    reference, _ = load_model(model_dir)
    steps = generate_step(mx.array(PROMPT), reference, max_tokens=MAX_TOKENS, kv_bits=bits,
                          kv_group_size=64, quantized_kv_start=0)
    assert ours == [int(t) for t, _ in steps]


def test_quantized_kv_restores_from_disk_token_identically(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "qwen3", overrides={
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64})
    writer = engine_over(model_dir, tmp_path / "c", kv_bits=4)
    run(writer)
    ram_hit, _ = run(writer)
    assert writer.cache.close(10).durable
    restored, stats = run(engine_over(model_dir, tmp_path / "c", kv_bits=4))
    assert stats.cached_from == "ssd" and restored == ram_hit
    # Another KV scheme never reads these entries.
    assert run(engine_over(model_dir, tmp_path / "c"))[1].cached_from is None


@pytest.mark.parametrize("sampling", [None, SamplingConfig(temp=0.8, seed=11)],
                         ids=["greedy", "sampled"])
def test_an_interrupted_generation_resumes_identically(model_dir, tmp_path, sampling,
                                                       dies_after):
    uninterrupted, _ = run(foretell.load(model_dir), sampling=sampling)
    engine = engine_over(model_dir, tmp_path)
    engine.cache.checkpoint_every = 3
    # The process "dies" after 8 tokens: no completion, no cleanup.
    assert len(dies_after(8, lambda: engine.generate(
        PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, sampling=sampling, resume=True))) >= 8
    assert engine.cache.flush(10).durable
    resumed, stats = run(engine_over(model_dir, tmp_path), sampling=sampling, resume=True)
    assert stats.cached_from == "checkpoint"
    assert resumed == uninterrupted
    # What the checkpoint held is said, counted as generated, and not taken for decode speed.
    assert 0 < stats.resumed_tokens <= 8 and stats.generated_tokens == MAX_TOKENS
    # A completed generation leaves no checkpoint behind.
    fresh = engine_over(model_dir, tmp_path)
    assert fresh.cache.ssd.entries() and not any(
        s.header.namespace.startswith("generation:") for s in fresh.cache.ssd.entries())


def test_a_request_run_again_in_the_same_process_checkpoints_anew(tmp_path, dies_after):
    """A completed resumable generation deletes its checkpoints; the same request again
    (the same prompt and settings, so the same checkpoint namespace) must still leave
    checkpoints to resume from when it is interrupted."""
    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    uninterrupted, _ = run(foretell.load(model_dir))
    engine = engine_over(model_dir, tmp_path / "c")
    engine.cache.checkpoint_every = 3
    assert run(engine, resume=True)[0] == uninterrupted  # completed: its checkpoints go
    dies_after(8, lambda: engine.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          resume=True))  # the second run "dies" here
    assert engine.cache.flush(10).durable
    resumed, stats = run(engine_over(model_dir, tmp_path / "c"), resume=True)
    assert stats.cached_from == "checkpoint" and resumed == uninterrupted


def test_another_setting_never_resumes_a_checkpoint(tmp_path, dies_after):
    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    engine = engine_over(model_dir, tmp_path / "c")
    engine.cache.checkpoint_every = 2
    dies_after(7, lambda: engine.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          resume=True))
    engine.cache.flush(10)
    # The checkpoint is there for the same settings ...
    assert run(engine_over(model_dir, tmp_path / "c"), resume=True)[1].cached_from \
        == "checkpoint"
    dies_after(7, lambda: engine.generate(PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          resume=True))
    engine.cache.flush(10)
    other = SamplingConfig(temp=0.5, seed=1)
    _, stats = run(engine_over(model_dir, tmp_path / "c"), sampling=other, resume=True)
    assert stats.cached_from != "checkpoint"


def test_engines_of_one_model_share_one_tier(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    first, second = foretell.load(model_dir), foretell.load(model_dir)
    first.cache = second.cache = CacheTier.for_engine(first, None)
    original, _ = run(first)
    shared, stats = run(second)
    assert stats.cached_from == "ram" and shared == original


def test_a_fine_tune_is_never_served_its_base_models_states(tmp_path):
    """Two models of one config and tokenizer, in directories of one name (as
    ``mlx_lm.convert`` names its output), differ only in their weights: a cache directory
    both use serves each its own states only, and neither engine takes the other's tier."""
    base = make_model_dir(tmp_path / "base" / "mlx_model", "qwen3", seed=0)
    tuned = make_model_dir(tmp_path / "tuned" / "mlx_model", "qwen3", seed=1)
    assert (base / "config.json").read_bytes() == (tuned / "config.json").read_bytes()
    run(engine_over(base, tmp_path / "kv"))
    tuned_engine = engine_over(tuned, tmp_path / "kv")
    tokens, stats = run(tuned_engine)
    assert stats.cached_tokens == 0
    assert tokens == run(foretell.load(tuned))[0]
    with pytest.raises(ConfigError, match="model_fingerprint"):
        foretell.load(base).cache = tuned_engine.cache


def test_the_same_model_at_another_precision_is_not_served_its_states(tmp_path, monkeypatch):
    """A quantized model runs unpacked to float32 on the CPU by default and packed in its
    scales' bfloat16 with FORETELL_CPU_UNPACK=0: the same model, other numerics. A cache
    directory both use serves each its own precision's states only."""
    model_dir = make_model_dir(tmp_path / "m", "qwen3", quantize_bits=4, dtype="bfloat16",
                               overrides={"hidden_size": 128, "intermediate_size": 256})
    unpacked = engine_over(model_dir, tmp_path / "kv")
    run(unpacked)
    assert unpacked.cache.flush(10).durable  # on disk before the other process-like tier opens
    monkeypatch.setenv("FORETELL_CPU_UNPACK", "0")
    packed = engine_over(model_dir, tmp_path / "kv")
    assert (unpacked.compute_dtype, packed.compute_dtype) == ("float32", "bfloat16")
    tokens, stats = run(packed)
    assert stats.cached_tokens == 0
    assert tokens == run(foretell.load(model_dir))[0]
    assert run(packed)[1].cached_from == "ram"  # its own states it reuses


def test_an_engine_given_a_directory_computes_its_identity_once(tmp_path, monkeypatch):
    """Opening the tier and assigning it both need the model's identity (the tokenizer
    hashed, the weights sampled): a start-up pays it once."""
    from foretell.store.entry import StoreIdentity

    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    computed = []
    original = StoreIdentity.for_model_dir.__func__

    def counted(cls, *args, **kwargs):
        computed.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(StoreIdentity, "for_model_dir", classmethod(counted))
    engine = foretell.load(model_dir, cache=tmp_path / "kv")
    engine.cache = engine.cache
    assert len(computed) == 1


def test_an_engine_refuses_a_tier_of_another_kv_scheme(tmp_path):
    model_dir = make_model_dir(tmp_path / "m", "qwen3")
    tier = CacheTier.for_engine(foretell.load(model_dir), tmp_path / "kv")
    with pytest.raises(ConfigError, match="kv_scheme plain.*kv_scheme kv8g64"):
        foretell.load(model_dir, kv_bits=8).cache = tier


def test_a_request_on_another_thread_reuses_what_an_earlier_one_stored(model_dir, tmp_path):
    """An integrator serving from a pool of threads: the entry a request on one thread
    stored serves a request on another (MLX's streams are per thread)."""
    engine = engine_over(model_dir, tmp_path / "kv")
    original, _ = run(engine)
    found = []
    worker = threading.Thread(target=lambda: found.append(run(engine)))
    worker.start()
    worker.join()
    tokens, stats = found[0]
    assert stats.cached_from == "ram" and tokens == original


def test_engines_on_two_threads_at_once_share_one_tier(model_dir, tmp_path):
    """Two engines of one model serving at once from two threads, each reusing what the
    main thread stored and what the other stores."""
    first = engine_over(model_dir, tmp_path / "kv")
    second = foretell.load(model_dir)
    second.cache = first.cache
    expected, _ = run(first)  # stored on this thread
    got: dict = {}

    def serve(engine):
        got[engine] = [run(engine) for _ in range(3)]

    workers = [threading.Thread(target=serve, args=(e,)) for e in (first, second)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(got) == 2  # a worker that raised left nothing
    for runs in got.values():
        assert [tokens for tokens, _ in runs] == [expected] * 3
        assert all(stats.cached_from == "ram" for _, stats in runs)


def test_caches_holding_tokens_the_sequence_does_not_name_are_not_stored(tmp_path, caplog):
    import logging

    from foretell.cache.codecs import load_codecs
    from foretell.cache.request import RequestCache
    from foretell.model import KVCache
    from foretell.plugin import load_plugins

    tier = CacheTier(load_codecs(load_plugins().registry))
    request = RequestCache(tier, "plain/plain")
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 2, 6, 16)), mx.zeros((1, 2, 6, 16)))
    with caplog.at_level(logging.WARNING):
        request.finish([1, 2, 3, 4, 5], [cache], completed=True)  # 6 held, 5 named
    assert len(tier.ram) == 0 and "not caching" in caplog.text
