"""Per-row speculation in the batch scheduler: every row streams what its request streams
decoded plainly alone, whatever drafter each row uses, however many of its drafts the target
keeps, and beside rows that do not speculate. The oracle is foretell's plain decoding of each
request alone, run as it runs."""

from __future__ import annotations

import collections

import pytest
from test_sampling_exact import _chi_square_p

from foretell.config import SamplingConfig
from foretell.scheduler import Scheduler

PROMPTS = [
    [5],
    [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199],
    [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42],
    [7, 3, 400, 12, 12, 9, 77, 31],
]
LENGTHS = [30, 45, 38, 12]


def _speculator(engine, kind, options, registry, k=3):
    from foretell.plugin import Kind
    from foretell.spec import make_speculator

    config = registry.get(Kind.DRAFT, kind).config
    return make_speculator(registry, engine.target, kind, config(**options), max_tokens=k,
                           adaptive=False)


def _drafters(name, model_dirs):
    yield "two-model self", ("two-model", {"model": str(model_dirs[name])})
    if name == "qwen3":
        yield "two-model other", ("two-model", {"model": str(model_dirs["qwen3-other"])})
    yield "ngram", ("ngram", {"max_ngram": 3})


def _alone(engine, prompt, **options):
    events = list(engine.generate(prompt, speculate=False, **options))
    return [t for e in events[:-1] for t in e.tokens]


def _streamed(handle):
    events = list(handle)
    return [t for e in events[:-1] for t in e.tokens], events[-1]


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_every_drafter_speculating_in_a_batch_reproduces_each_row_alone(
        engines, model_dirs, registry, name):
    engine = engines[name]
    plain = [_alone(engine, p, max_tokens=n, ignore_eos=True) for p, n in zip(PROMPTS, LENGTHS)]
    for label, (kind, options) in _drafters(name, model_dirs):
        speculator = _speculator(engine, kind, options, registry)
        scheduler = Scheduler(engine)
        handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True, speculate=speculator)
                   for p, n in zip(PROMPTS, LENGTHS)]
        forwards = 0
        for want, handle in zip(plain, handles):
            tokens, stats = _streamed(handle)
            assert tokens == want, label
            forwards += stats.speculation["target_forwards"]
        if label == "two-model self":  # a self-draft is kept whole: far fewer forwards
            assert forwards < sum(LENGTHS) / 2
        scheduler.close()


def test_rows_with_different_drafters_and_none_share_one_batch(engines, model_dirs, registry,
                                                               monkeypatch):
    engine = engines["qwen3"]
    drafters = [_speculator(engine, "two-model", {"model": str(model_dirs["qwen3"])}, registry),
                _speculator(engine, "ngram", {"max_ngram": 3}, registry, k=5),
                False,
                _speculator(engine, "two-model", {"model": str(model_dirs["qwen3-other"])},
                            registry, k=2)]
    scheduler = Scheduler(engine)
    groups = []  # each drafter's rows, as the scheduler makes them
    made = Scheduler._group
    monkeypatch.setattr(Scheduler, "_group",
                        lambda self, *args: groups.append(made(self, *args)) or groups[-1])
    handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True, speculate=s)
               for p, n, s in zip(PROMPTS, LENGTHS, drafters)]
    for prompt, n, handle in zip(PROMPTS, LENGTHS, handles):
        assert _streamed(handle)[0] == _alone(engine, prompt, max_tokens=n, ignore_eos=True)
    # The two-model drafter serves its rows natively (plugin API 2), n-gram through its
    # per-request sources.
    kinds = {group.speculator.kind: type(group.rows).__name__ for group in groups}
    assert kinds["two-model"] == "TwoModelRows"
    scheduler.close()


def test_seeded_sampled_rows_speculating_draw_exactly_what_they_draw_alone(
        engines, model_dirs, registry):
    engine = engines["qwen3"]
    speculator = _speculator(engine, "two-model", {"model": str(model_dirs["qwen3-other"])},
                             registry)
    settings = [SamplingConfig(temp=0.8, seed=3), SamplingConfig(temp=1.0, top_k=20, seed=9),
                SamplingConfig(temp=0.7, top_p=0.9, seed=1), SamplingConfig(temp=1.1, seed=4)]
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=20, ignore_eos=True, sampling=s,
                                speculate=speculator) for p, s in zip(PROMPTS, settings)]
    for prompt, sampling, handle in zip(PROMPTS, settings, handles):
        assert _streamed(handle)[0] == _alone(engine, prompt, max_tokens=20, ignore_eos=True,
                                              sampling=sampling)
    scheduler.close()


def test_unseeded_sampled_rows_speculating_keep_plain_samplings_distribution(
        engines, model_dirs, registry):
    """Rejection sampling per row: the 2nd and 3rd tokens' distribution over many requests
    run in batches equals plain sampling's (two-sample chi-square)."""
    engine = engines["qwen3"]
    speculator = _speculator(engine, "two-model", {"model": str(model_dirs["qwen3-other"])},
                             registry)
    sampling = SamplingConfig(temp=0.6, top_k=6)
    runs = 480
    scheduler = Scheduler(engine, max_rows=48)
    handles = [scheduler.submit(PROMPTS[1], max_tokens=3, ignore_eos=True, sampling=sampling,
                                speculate=speculator) for _ in range(runs)]
    batched = [_streamed(h)[0] for h in handles]
    scheduler.close()
    plain = [_alone(engine, PROMPTS[1], max_tokens=3, ignore_eos=True, sampling=sampling)
             for _ in range(runs)]
    for position in (1, 2):
        a = collections.Counter(t[position] for t in batched)
        b = collections.Counter(t[position] for t in plain)
        ids = sorted(set(a) | set(b))
        import numpy as np

        p = _chi_square_p(np.array([a[i] for i in ids]), np.array([b[i] for i in ids]))
        assert p > 1e-4, (position, a, b)


def test_kernels_compiling_in_workers_and_the_drafters_land_before_a_batch_forward(
        engines, model_dirs, registry, monkeypatch):
    """On CUDA the batch waits for the kernels compiling since load, and starts and waits for
    each drafter's, before a row's first forward: a kernel the engine compiles itself there
    stalls every row for half a minute (the CUDA backend stands in here)."""
    import threading
    import types

    from foretell.platform import device

    engine = engines["qwen3"]
    calls = []
    kernels = types.SimpleNamespace(
        precompile=lambda *owners: calls.append(("precompile", owners)),
        wait=lambda: calls.append(("wait",)))
    monkeypatch.setattr(device, "cuda_backend", lambda: types.SimpleNamespace(kernels=kernels))
    forward = type(engine.model).forward

    def recorded(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():  # the batch's worker
            calls.append(("forward",))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.model), "forward", recorded)
    speculator = _speculator(engine, "two-model", {"model": str(model_dirs["qwen3-other"])},
                             registry)
    drafted = [("precompile", (speculator.provider,))]
    for speculate, precompiled in ((False, []), (speculator, drafted)):
        calls.clear()
        handle = Scheduler(engine).submit(PROMPTS[1], max_tokens=4, speculate=speculate)
        _streamed(handle)
        first = calls.index(("forward",))
        assert calls[:first] == [*precompiled, ("wait",)], calls[:first + 1]


def test_a_drafters_kernels_are_started_once_per_scheduler(engines, model_dirs, registry,
                                                           monkeypatch):
    """Starting a drafter's compiles walks its modules: the first request does, not each."""
    import types

    from foretell.platform import device

    engine = engines["qwen3"]
    started = []
    kernels = types.SimpleNamespace(precompile=lambda *owners: started.append(owners),
                                    wait=lambda: None)
    monkeypatch.setattr(device, "cuda_backend", lambda: types.SimpleNamespace(kernels=kernels))
    speculator = _speculator(engine, "two-model", {"model": str(model_dirs["qwen3-other"])},
                             registry)
    scheduler = Scheduler(engine)
    for prompt in PROMPTS[:3]:
        _streamed(scheduler.submit(prompt, max_tokens=4, speculate=speculator))
    assert started == [(speculator.provider,)]
