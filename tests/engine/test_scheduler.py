"""The batch scheduler: every request streams exactly what it streams run alone (CPU,
float32), whatever else runs beside it: rows of different prompt lengths joining and leaving
at different steps, stop strings, sampled rows, a sliding window that wraps, prefix-cache
hits and misses in one batch, callers on many threads, cancellation and a KV budget."""

from __future__ import annotations

import threading

import pytest

import foretell
from foretell.cache.codecs import load_codecs
from foretell.cache.tier import CacheTier
from foretell.config import SamplingConfig
from foretell.errors import GenerationError
from foretell.model.batch import BatchKVCache
from foretell.scheduler import Scheduler
from foretell.tools import make_model_dir

QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
GEMMA = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
         "sliding_window": 8, "sliding_window_pattern": 3}

PROMPTS = ["def fib(n):", "import os\nimport sys\n\nclass Walker:\n    def __init__(self):",
           "x = 1", "for i in range(10):\n    print(i, i * i)\n# done\n" * 3]


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text"])
def engine(request, tmp_path_factory):
    overrides = QWEN if request.param == "qwen3" else GEMMA
    path = make_model_dir(tmp_path_factory.mktemp(request.param), request.param,
                          overrides=overrides, seed=0)
    return foretell.load(path)


def alone(engine, prompt, **options):
    """Tokens and text the request streams run by itself through ``generate``."""
    events = list(engine.generate(prompt, speculate=False, **options))
    tokens = [t for e in events if e.type == "text" for t in e.tokens]
    return tokens, "".join(e.text for e in events if e.type == "text"), events[-1]


def batched(handle):
    events = list(handle)
    tokens = [t for e in events if e.type == "text" for t in e.tokens]
    return tokens, "".join(e.text for e in events if e.type == "text"), events[-1]


def test_rows_joining_and_leaving_at_different_steps_stream_what_each_streams_alone(engine):
    scheduler = Scheduler(engine)
    lengths = [24, 7, 31, 12]
    handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True)
               for p, n in zip(PROMPTS, lengths)]
    for prompt, n, handle in zip(PROMPTS, lengths, handles):
        tokens, text, stats = batched(handle)
        want_tokens, want_text, want_stats = alone(engine, prompt, max_tokens=n, ignore_eos=True)
        assert tokens == want_tokens
        assert text == want_text
        assert stats.finish_reason == want_stats.finish_reason == "length"
        assert stats.generated_tokens == n
    scheduler.close()


def test_a_stop_string_ends_only_its_own_row(engine):
    _, text, _ = alone(engine, PROMPTS[0], max_tokens=20, ignore_eos=True)
    stop = text[6:9]
    scheduler = Scheduler(engine)
    stopped = scheduler.submit(PROMPTS[0], max_tokens=20, ignore_eos=True, stop=[stop])
    other = scheduler.submit(PROMPTS[1], max_tokens=20, ignore_eos=True)
    _, stopped_text, stopped_stats = batched(stopped)
    _, want_text, want_stats = alone(engine, PROMPTS[0], max_tokens=20, ignore_eos=True,
                                     stop=[stop])
    assert stopped_text == want_text
    assert stopped_stats.finish_reason == want_stats.finish_reason == "stop"
    assert batched(other)[0] == alone(engine, PROMPTS[1], max_tokens=20, ignore_eos=True)[0]
    scheduler.close()


def test_seeded_sampled_rows_draw_exactly_what_they_draw_alone(engine):
    settings = [SamplingConfig(temp=0.8, seed=3), SamplingConfig(temp=1.0, top_k=20, seed=9),
                SamplingConfig(temp=0.7, top_p=0.9, repetition_penalty=1.3, seed=1)]
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=16, ignore_eos=True, sampling=s)
               for p, s in zip(PROMPTS, settings)]
    for prompt, sampling, handle in zip(PROMPTS, settings, handles):
        assert batched(handle)[0] == alone(engine, prompt, max_tokens=16, ignore_eos=True,
                                           sampling=sampling)[0]
    scheduler.close()


def test_prefix_cache_hits_and_misses_mix_in_one_batch(tmp_path_factory):
    path = make_model_dir(tmp_path_factory.mktemp("cached"), "qwen3", overrides=QWEN, seed=0)
    engine = foretell.load(path)
    engine.cache = CacheTier(load_codecs(engine.registry))
    want = {p: alone(engine, p, max_tokens=10, ignore_eos=True, chat=False)[0] for p in PROMPTS[:2]}
    scheduler = Scheduler(engine)
    hit = scheduler.submit(PROMPTS[0], max_tokens=10, ignore_eos=True, chat=False)  # stored by alone()
    miss = scheduler.submit("@@ nothing stored starts so", max_tokens=10, ignore_eos=True, chat=False)
    tokens, _, stats = batched(hit)
    assert stats.cached_tokens > 0
    assert tokens == want[PROMPTS[0]]
    assert batched(miss)[2].cached_tokens == 0
    # What the batch stored serves the next request.
    again = scheduler.submit("@@ nothing stored starts so", max_tokens=10, ignore_eos=True, chat=False)
    assert batched(again)[2].cached_tokens > 0
    scheduler.close()


def test_a_hundred_requests_from_eight_threads_each_get_their_own_output(engine):
    want = {p: alone(engine, p, max_tokens=6, ignore_eos=True)[0] for p in PROMPTS}
    scheduler = Scheduler(engine, max_rows=8)
    wrong: list[str] = []

    def client(worker: int) -> None:
        for i in range(worker, 100, 8):
            prompt = PROMPTS[i % len(PROMPTS)]
            tokens = batched(scheduler.submit(prompt, max_tokens=6, ignore_eos=True))[0]
            if tokens != want[prompt]:
                wrong.append(f"request {i}: {tokens} != {want[prompt]}")

    threads = [threading.Thread(target=client, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert wrong == []
    scheduler.close()


def test_cancelling_mid_stream_frees_the_row_and_the_next_request_runs(engine):
    scheduler = Scheduler(engine)
    handle = scheduler.submit(PROMPTS[0], max_tokens=10_000, ignore_eos=True)
    stream = iter(handle)
    next(stream)
    handle.cancel()
    list(stream)  # ends: no stats for a cancelled request
    follow = scheduler.submit(PROMPTS[2], max_tokens=5, ignore_eos=True)
    assert batched(follow)[0] == alone(engine, PROMPTS[2], max_tokens=5, ignore_eos=True)[0]
    assert scheduler.running == 0 and scheduler.live_kv_bytes() == 0
    scheduler.close()


class Recording(Scheduler):
    """Records how many rows each decode step ran."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.widths: list[int] = []

    def _step(self) -> None:
        self.widths.append(len(self._rows))
        super()._step()


def test_over_the_kv_budget_admission_waits_and_every_request_completes(engine):
    probe = Scheduler(engine)
    one = probe._reserve_bytes(1, 256)  # one request of under 256 tokens
    scheduler = Recording(engine, kv_budget_bytes=one)
    handles = [scheduler.submit(p, max_tokens=8, ignore_eos=True) for p in PROMPTS[:3]]
    for prompt, handle in zip(PROMPTS, handles):
        assert batched(handle)[0] == alone(engine, prompt, max_tokens=8, ignore_eos=True)[0]
    assert max(scheduler.widths) == 1
    scheduler.close()
    probe.close()


def test_a_request_that_can_never_fit_is_refused_with_the_numbers(engine):
    scheduler = Scheduler(engine, kv_budget_bytes=1024)
    with pytest.raises(GenerationError, match=r"can never fit: \d+ tokens"):
        scheduler.submit(PROMPTS[0], max_tokens=100)
    scheduler.close()


def test_logprobs_report_each_tokens_log_probability_under_the_model(engine):
    import mlx.core as mx

    scheduler = Scheduler(engine)
    events = [e for e in scheduler.submit(PROMPTS[0], max_tokens=4, ignore_eos=True,
                                          logprobs=3, chat=False) if e.type == "text"]
    first = events[0].logprobs[0]
    assert first.token == events[0].tokens[0]
    assert [t for t, _ in first.top][0] == first.token  # greedy takes the most likely
    ids = engine.encode_prompt(PROMPTS[0], chat=False)
    hidden, _ = engine.model.forward(mx.array([ids]), engine.make_caches())
    logits = engine.model.logits(hidden[:, -1, :])[0]
    want = (logits - mx.logsumexp(logits)).tolist()
    assert first.logprob == pytest.approx(want[first.token], abs=1e-4)
    assert [lp for _, lp in first.top] == pytest.approx(sorted(want, reverse=True)[:3], abs=1e-4)
    scheduler.close()


class OnlyThese:
    """A constraint: tokens from ``allowed`` only, complete after ``length`` of them."""

    def __init__(self, vocab: int, allowed: list[int], length: int):
        self.vocab, self.ids, self.length, self.taken = vocab, allowed, length, []

    def allowed(self):
        import mlx.core as mx

        mask = mx.zeros((self.vocab,), dtype=mx.bool_)  # made on the scheduler's thread
        mask[mx.array(self.ids)] = True
        return mask

    def accept(self, token: int) -> None:
        self.taken.append(token)

    def complete(self) -> bool:
        return len(self.taken) >= self.length


def test_a_constraint_limits_every_token_and_ends_the_request_when_complete(engine):
    allowed = [7, 11, 13]
    constraint = OnlyThese(engine.model.vocab_size, allowed, 5)
    scheduler = Scheduler(engine)
    free = scheduler.submit(PROMPTS[1], max_tokens=12, ignore_eos=True)
    tokens, _, stats = batched(scheduler.submit(PROMPTS[0], max_tokens=50, ignore_eos=True,
                                                sampling=SamplingConfig(temp=1.0, seed=2),
                                                constraint=constraint))
    assert set(tokens) <= set(allowed) and len(tokens) == 5
    assert stats.finish_reason == "stop"
    assert batched(free)[0] == alone(engine, PROMPTS[1], max_tokens=12, ignore_eos=True)[0]
    scheduler.close()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_rows_stream_what_each_streams_alone(tmp_path_factory, bits):
    path = make_model_dir(tmp_path_factory.mktemp(f"q{bits}"), "qwen3",
                          overrides={**QWEN, "head_dim": 64}, seed=0)
    engine = foretell.load(path, kv_bits=bits)
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True)
               for p, n in zip(PROMPTS, [20, 9, 14, 6])]
    for prompt, n, handle in zip(PROMPTS, [20, 9, 14, 6], handles):
        assert batched(handle)[0] == alone(engine, prompt, max_tokens=n, ignore_eos=True)[0]
    scheduler.close()


def test_a_failing_step_fails_its_requests_and_the_worker_serves_the_next(engine, monkeypatch):
    scheduler = Scheduler(engine)
    list(scheduler.submit(PROMPTS[2], max_tokens=2, ignore_eos=True))  # the worker is up
    forward = engine.model.forward
    calls = {"n": 0}

    def broken_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the device fell over")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", broken_once)
    with pytest.raises(GenerationError, match="the device fell over"):
        list(scheduler.submit(PROMPTS[0], max_tokens=5, ignore_eos=True))
    monkeypatch.setattr(engine.model, "forward", forward)
    follow = scheduler.submit(PROMPTS[1], max_tokens=5, ignore_eos=True)
    assert batched(follow)[0] == alone(engine, PROMPTS[1], max_tokens=5, ignore_eos=True)[0]
    scheduler.close()


def test_a_row_that_cannot_join_the_batch_fails_and_the_worker_serves_the_next(engine,
                                                                              monkeypatch):
    import foretell.scheduler as scheduler_module

    scheduler = Scheduler(engine)
    real = scheduler_module.batch_caches

    def broken(*args, **kwargs):
        raise TypeError("a layer the batch cannot hold")

    monkeypatch.setattr(scheduler_module, "batch_caches", broken)
    with pytest.raises(GenerationError, match="cannot hold"):
        list(scheduler.submit(PROMPTS[0], max_tokens=5, ignore_eos=True))
    monkeypatch.setattr(scheduler_module, "batch_caches", real)
    follow = scheduler.submit(PROMPTS[1], max_tokens=5, ignore_eos=True)
    assert batched(follow)[0] == alone(engine, PROMPTS[1], max_tokens=5, ignore_eos=True)[0]
    scheduler.close()


def test_engine_submit_from_several_threads_streams_what_generate_streams(engine):
    want = {p: alone(engine, p, max_tokens=8, ignore_eos=True)[0] for p in PROMPTS}
    got: dict[str, list[int]] = {}

    def client(prompt: str) -> None:
        got[prompt] = batched(engine.submit(prompt, max_tokens=8, ignore_eos=True))[0]

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert got == want


def test_pipelined_rows_with_different_sampling_and_a_row_forcing_synchronous_steps(engine):
    """Rows under different settings are drawn together in pipelined steps; a row that
    needs its tokens on the host (logprobs) joining midway makes the steps synchronous
    until it leaves: every row still draws exactly what it draws alone."""
    import time

    settings = [None, SamplingConfig(temp=0.8, seed=3), None,
                SamplingConfig(temp=1.0, top_k=20, seed=9)]
    lengths = [30, 22, 14, 26]
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True, sampling=s)
               for p, n, s in zip(PROMPTS, lengths, settings)]
    time.sleep(0.05)
    reporting = scheduler.submit(PROMPTS[2], max_tokens=5, ignore_eos=True, logprobs=2)
    for prompt, n, s, handle in zip(PROMPTS, lengths, settings, handles):
        assert batched(handle)[0] == alone(engine, prompt, max_tokens=n, ignore_eos=True,
                                           sampling=s)[0]
    events = [e for e in reporting if e.type == "text"]
    assert [t for e in events for t in e.tokens] == \
        alone(engine, PROMPTS[2], max_tokens=5, ignore_eos=True)[0]
    assert all(e.logprobs for e in events)
    scheduler.close()


def test_a_row_ending_in_a_pipelined_step_stores_what_its_kv_holds(tmp_path_factory):
    """A pipelined row ends with its last token already in the KV: the entry it stores
    says so, and a follow-up prompt extending the output reuses it and decodes as cold."""
    path = make_model_dir(tmp_path_factory.mktemp("piped"), "qwen3", overrides=QWEN, seed=0)
    engine = foretell.load(path)
    engine.cache = CacheTier(load_codecs(engine.registry))
    scheduler = Scheduler(engine)
    ids = engine.encode_prompt(PROMPTS[1])
    tokens, _, _ = batched(scheduler.submit(ids, max_tokens=12, ignore_eos=True))
    follow = ids + tokens + tokens[:3]
    got, _, stats = batched(scheduler.submit(follow, max_tokens=8, ignore_eos=True))
    assert stats.cached_tokens >= len(ids) + len(tokens) - 1
    engine.cache = None
    assert got == alone(engine, follow, max_tokens=8, ignore_eos=True)[0]
    scheduler.close()


def test_a_row_ending_beside_others_stores_behind_the_next_step_and_ends_after(
        tmp_path_factory, monkeypatch):
    """A row ending while others decode on stores its KV once the next step (without it) is
    dispatched, not by waiting for the step in flight; its END still follows the store, so a
    follow-up turn sent on END reuses it."""
    path = make_model_dir(tmp_path_factory.mktemp("behind"), "qwen3", overrides=QWEN, seed=0)
    engine = foretell.load(path)
    engine.cache = CacheTier(load_codecs(engine.registry))
    scheduler = Scheduler(engine)
    ids = engine.encode_prompt(PROMPTS[1])
    list(scheduler.submit(ids, max_tokens=2, ignore_eos=True))  # the worker is up, warm
    forward, store, seen = engine.model.forward, engine.cache.store, []

    def watched(tokens, caches, *args, **kwargs):
        seen.append(("forward", tuple(tokens.shape)))
        return forward(tokens, caches, *args, **kwargs)

    def storing(tokens, caches, namespace=""):
        seen.append(("store", len(tokens)))
        return store(tokens, caches, namespace)

    monkeypatch.setattr(engine.model, "forward", watched)
    monkeypatch.setattr(engine.cache, "store", storing)
    short_ids = engine.encode_prompt(PROMPTS[0])
    long = scheduler.submit(ids, max_tokens=24, ignore_eos=True)
    short = scheduler.submit(short_ids, max_tokens=4, ignore_eos=True)
    tokens, _, _ = batched(short)
    follow = short_ids + tokens + tokens[:2]
    got, _, stats = batched(scheduler.submit(follow, max_tokens=4, ignore_eos=True))
    batched(long)
    # The short row's whole sequence (its last token in the KV) is stored after the step
    # without it was dispatched: a decode step of the long row alone after the last of both.
    at = seen.index(("store", len(short_ids) + len(tokens)))
    both = max(i for i, e in enumerate(seen[:at]) if e == ("forward", (2, 1)))
    assert ("forward", (1, 1)) in seen[both:at]
    assert stats.cached_tokens >= len(short_ids) + len(tokens) - 1
    monkeypatch.setattr(engine.model, "forward", forward)
    engine.cache = None
    assert got == alone(engine, follow, max_tokens=4, ignore_eos=True)[0]
    scheduler.close()


def _burst(engine, monkeypatch, prompts):
    """Each prompt's tokens and the row counts of the decode steps, the prompts all arriving
    at an idle scheduler before its worker takes any (prefill chunks of 32 tokens)."""
    import foretell.request as request_module

    monkeypatch.setattr(request_module, "PREFILL_CHUNK", 32)
    scheduler = Scheduler(engine)
    take, go, rows = scheduler._take_new, threading.Event(), []

    def held(block):
        go.wait(timeout=60)
        return take(block)

    forward = engine.model.forward

    def watched(tokens, caches, *args, **kwargs):
        if tokens.shape[1] == 1:
            rows.append(tokens.shape[0])
        return forward(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(scheduler, "_take_new", held)
    handles = [scheduler.submit(p, max_tokens=6, ignore_eos=True) for p in prompts]
    monkeypatch.setattr(engine.model, "forward", watched)  # (the first submit ran one too)
    go.set()
    outputs = [batched(h)[0] for h in handles]
    monkeypatch.setattr(engine.model, "forward", forward)
    for prompt, got in zip(prompts, outputs):
        assert got == alone(engine, prompt, max_tokens=6, ignore_eos=True)[0]
    scheduler.close()
    return rows


def test_a_burst_into_an_idle_batch_prefills_past_one_chunk_and_joins_at_one_length(
        engine, monkeypatch):
    """Prompts arriving while no row decodes all prefill before the first step, past one
    chunk's worth (up to BURST_CHUNKS chunks): their rows decode at one length (no mask)."""
    prompts = [[20 + (7 * i + j) % 400 for j in range(10)] for i in range(6)]
    rows = _burst(engine, monkeypatch, prompts)
    assert rows[0] == len(prompts)  # one chunk (32 tokens) would have started three


def test_a_burst_prefills_no_more_rows_at_once_than_a_full_chunk_has_attention_scores(
        engine, monkeypatch):
    """Rows x longest^2 of one iteration's prompts stays within a full chunk's (32^2): of
    three 20-token prompts two go first, the third next."""
    prompts = [[20 + (5 * i + j) % 400 for j in range(20)] for i in range(3)]
    rows = _burst(engine, monkeypatch, prompts)
    assert rows[0] == 2 and 3 in rows


def test_prompts_arriving_together_are_prefilled_in_one_forward(engine, monkeypatch):
    """Prompts waiting at the same step share one prefill forward (padded to the longest,
    the padding trimmed off each row) and still stream what each streams alone."""
    scheduler = Scheduler(engine)
    list(scheduler.submit(PROMPTS[2], max_tokens=2, ignore_eos=True))  # the worker is up
    forward, shapes = engine.model.forward, []
    held, go = threading.Event(), threading.Event()

    def watched(tokens, caches, *args, **kwargs):
        shapes.append(tuple(tokens.shape))
        if not held.is_set():  # the first decode step waits until every prompt is queued
            held.set()
            go.wait(timeout=60)
        return forward(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", watched)
    merge, merged = BatchKVCache.merge, []

    def merging(cache, other):
        merged.append(other.rows)
        return merge(cache, other)

    monkeypatch.setattr(BatchKVCache, "merge", merging)
    first = scheduler.submit(PROMPTS[0], max_tokens=12, ignore_eos=True)
    assert held.wait(timeout=60)
    together = [scheduler.submit(p, max_tokens=n, ignore_eos=True)
                for p, n in zip(PROMPTS[1:], [9, 14, 6])]
    go.set()
    outputs = [batched(h)[0] for h in [first, *together]]
    monkeypatch.setattr(engine.model, "forward", forward)
    lengths = [len(engine.encode_prompt(p)) - 1 for p in PROMPTS[1:]]
    shared = [s for s in shapes if s[0] > 1 and s[1] > 1]
    windowed = any(getattr(c, "max_size", None) is not None for c in engine.make_caches())
    if not windowed:  # a sliding-window model prefills each prompt alone (its own window)
        assert (len(PROMPTS) - 1, max(lengths)) in shared
        # ... and they join the running batch as the shared batch's rows, merged in whole.
        assert len(PROMPTS) - 1 in merged
    for prompt, n, got in zip(PROMPTS, [12, 9, 14, 6], outputs):
        assert got == alone(engine, prompt, max_tokens=n, ignore_eos=True)[0]
    scheduler.close()
