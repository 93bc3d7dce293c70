"""Verify windows compiled over fixed shapes (foretell.model.fixed, on by default on CUDA)
compute what the ordinary forward computes, keep greedy speculation token-identical to plain
decoding, never write into a donor's buffers, and fall back whole when a model needs more of
its caches than the cache protocol. Forced on here (the CPU's default is off)."""

from __future__ import annotations

import logging

import mlx.core as mx
import pytest

from foretell.model import fixed
from foretell.model.kvcache import KVCache, RotatingKVCache


@pytest.fixture
def forced_on(monkeypatch):
    monkeypatch.setattr(fixed, "_MODE", "on")
    calls = []
    real = fixed.FixedForward.__call__

    def counted(self, *arrays, caches, length):
        qualifies = fixed.fits_fixed_shapes(caches)  # others take the ordinary forward
        out = real(self, *arrays, caches=caches, length=length)
        if qualifies:
            calls.append(out is not None)
        return out

    monkeypatch.setattr(fixed.FixedForward, "__call__", counted)
    return calls


def _verify(model, window, caches):
    """A verify window's forward: the target's hidden states and logits over ``window``."""
    hidden, _ = model.forward(window, caches)
    return hidden, model.logits(hidden)


def _prefilled(model, tokens):
    caches = model.make_caches()
    model.forward(mx.array([tokens]), caches)
    mx.eval([c.state for c in caches])
    return caches


def test_a_fixed_forward_matches_the_ordinary_one_across_capacity_steps(
    engines, monkeypatch
):
    model = engines["qwen3"].model
    monkeypatch.setattr(fixed, "CAPACITY_STEP", 16)  # cross several steps in a few windows
    run = fixed.FixedForward(model, _verify, "test forward")
    ordinary, fixed_caches = _prefilled(model, list(range(3, 14))), _prefilled(model, list(range(3, 14)))
    for i, width in enumerate([4, 2, 5, 1, 3, 6, 4, 2]):
        window = mx.array([[(7 * i + j) % 200 + 1 for j in range(width)]])
        hidden_a, logits_a = _verify(model, window, ordinary)
        hidden_b, logits_b = run(window, caches=fixed_caches, length=width)
        assert mx.allclose(logits_a, logits_b, atol=1e-4).item(), f"window {i}"
        assert mx.allclose(hidden_a, hidden_b, atol=1e-4).item()
        drop = width // 2  # roll back part of each window, as a verify round does
        for caches in (ordinary, fixed_caches):
            for c in caches:
                c.trim(drop)
    assert fixed_caches[0].keys.shape[2] % 16 == 0
    for a, b in zip(ordinary, fixed_caches):
        assert a.offset == b.offset
        assert mx.allclose(a.state[0], b.state[0], atol=1e-5).item()


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text"])
def test_greedy_speculation_over_fixed_shapes_reproduces_plain_decoding(
    engines, model_dirs, registry, forced_on, name
):
    from foretell.plugin import Kind

    engine = engines[name]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = engine.use_draft("two-model", config(model=str(model_dirs[name])),
                                  max_tokens=3, adaptive=False)
    prompt = [11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199]
    plain = [t for e in engine.generate(prompt, speculate=False, max_tokens=50, ignore_eos=True)
             for t in getattr(e, "tokens", ())]
    forced_on.clear()
    spec = [t for e in engine.generate(prompt, speculate=speculator, max_tokens=50,
                                       ignore_eos=True) for t in getattr(e, "tokens", ())]
    assert spec == plain
    if name == "gemma3_text":  # sliding-window layers keep rings: never the fixed forward
        assert not forced_on


def test_a_lone_requests_verify_windows_take_the_fixed_path(engines, model_dirs, registry,
                                                            forced_on):
    from foretell.plugin import Kind

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = engine.use_draft("two-model", config(model=str(model_dirs["qwen3"])),
                                  max_tokens=3, adaptive=False)
    forced_on.clear()
    list(engine.generate([11, 57, 300, 4, 89, 120, 7], speculate=speculator, max_tokens=20,
                         ignore_eos=True))
    assert forced_on and all(forced_on)  # every verify window took the fixed path


def _one_row_batch(model, tokens):
    """The batch caches of ``model`` holding one row: ``tokens`` prefilled."""
    from foretell.model.batch import batch_caches

    batch = batch_caches(model)
    for layer, single in zip(batch, _prefilled(model, tokens)):
        layer.append([single])
    return batch


def test_a_one_row_batchs_fixed_forward_matches_the_ordinary_one_across_capacity_steps(
    engines, monkeypatch
):
    """The scheduler's lone row: its batch caches' whole buffers at the row's length."""
    model = engines["qwen3"].model
    monkeypatch.setattr(fixed, "CAPACITY_STEP", 16)
    run = fixed.FixedForward(model, _verify, "test forward")
    prompt = list(range(3, 14))
    ordinary, fixed_caches = _one_row_batch(model, prompt), _one_row_batch(model, prompt)
    for i, width in enumerate([4, 2, 5, 1, 3, 6, 4, 2]):
        window = mx.array([[(7 * i + j) % 200 + 1 for j in range(width)]])
        hidden_a, logits_a = _verify(model, window, ordinary)
        out = run(window, caches=fixed_caches, length=width)
        assert out is not None, f"window {i} took the ordinary path"
        hidden_b, logits_b = out
        assert mx.allclose(logits_a, logits_b, atol=1e-4).item(), f"window {i}"
        assert mx.allclose(hidden_a, hidden_b, atol=1e-4).item()
        drop = width // 2
        for caches in (ordinary, fixed_caches):
            for c in caches:
                c.trim([drop])
        # RoPE's positions: the row's next one, on the device, as the ordinary path keeps it
        assert fixed_caches[0].offset.tolist() == ordinary[0].offset.tolist()
    assert fixed_caches[0].buffers[0].shape[2] % 16 == 0
    for a, b in zip(ordinary, fixed_caches):
        assert a.lengths == b.lengths
        assert mx.allclose(a.extract(0).state[0], b.extract(0).state[0], atol=1e-5).item()


def test_batches_of_several_rows_windows_or_quantized_kv_keep_the_ordinary_forward(engines):
    from foretell.model.batch import BatchKVCache

    def batch(rows, **kw):
        cache = BatchKVCache(**kw)
        singles = []
        for n in rows:
            single = KVCache()
            single.update_and_fetch(mx.zeros((1, 2, n, 64)), mx.zeros((1, 2, n, 64)))
            singles.append(single)
        cache.append(singles)
        return cache

    assert fixed.fits_fixed_shapes([batch([3]), batch([3])])
    assert not fixed.fits_fixed_shapes([batch([3]), batch([4])])  # layers apart
    assert not fixed.fits_fixed_shapes([batch([3, 3])])  # each row count a trace of its own
    assert not fixed.fits_fixed_shapes([batch([3], window=8)])
    assert not fixed.fits_fixed_shapes([batch([3], bits=8)])
    assert not fixed.fits_fixed_shapes([BatchKVCache()])  # no buffers yet
    empty = BatchKVCache()
    empty.append([None])  # a row, but nothing written
    assert not fixed.fits_fixed_shapes([empty])
    model = engines["qwen3"].model
    run = fixed.FixedForward(model, _verify, "test forward")
    two = _one_row_batch(model, list(range(3, 14)))
    for layer, single in zip(two, _prefilled(model, list(range(20, 29)))):
        layer.append([single])
    assert run(mx.array([[4, 5], [6, 7]]), caches=two, length=2) is None
    assert [c.lengths for c in two] == [[11, 9]] * len(two)  # untouched


def test_a_row_joins_a_batch_whose_lone_row_ran_over_fixed_shapes(engines):
    """The lone row's buffers grew to a whole capacity step, more slots than its length
    needs; a joining row takes that capacity and both keep their tokens."""
    model = engines["qwen3"].model
    run = fixed.FixedForward(model, _verify, "test forward")
    batch = _one_row_batch(model, list(range(3, 14)))
    run(mx.array([[4, 5, 6]]), caches=batch, length=3)
    capacity = batch[0].buffers[0].shape[2]
    assert capacity == fixed.CAPACITY_STEP
    before = batch[0].extract(0).state[0]
    joining = _prefilled(model, list(range(40, 45)))
    for layer, single in zip(batch, joining):
        layer.append([single])
    assert batch[0].lengths == [14, 5] and batch[0].buffers[0].shape[2] == capacity
    assert mx.array_equal(batch[0].extract(0).state[0], before).item()
    assert mx.array_equal(batch[0].extract(1).state[0], joining[0].state[0]).item()


def test_requests_joining_and_leaving_a_lone_row_over_fixed_shapes_decode_as_alone(
    engines, model_dirs, registry, forced_on, held_mid_request
):
    """The first request speculates alone over fixed shapes, a second joins its batch (the
    ordinary forward for both), one leaves, and the other goes on alone over fixed
    shapes again: each streams what it decodes plainly alone."""

    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=3,
                                 adaptive=False)
    prompts, lengths = [[11, 57, 300, 4, 89, 120, 7], [7, 3, 400, 12, 12, 9, 77, 31]], [60, 40]
    plain = [[t for e in engine.generate(p, speculate=False, max_tokens=n, ignore_eos=True)
              for t in getattr(e, "tokens", ())] for p, n in zip(prompts, lengths)]
    paused, go, rows = held_mid_request()
    scheduler = Scheduler(engine)
    forced_on.clear()
    first = scheduler.submit(prompts[0], max_tokens=lengths[0], ignore_eos=True,
                             speculate=speculator)
    assert paused.wait(60)
    alone = len(forced_on)
    second = scheduler.submit(prompts[1], max_tokens=lengths[1], ignore_eos=True,
                              speculate=speculator)
    go.set()
    assert [t for e in first for t in getattr(e, "tokens", ())] == plain[0]
    assert [t for e in second for t in getattr(e, "tokens", ())] == plain[1]
    scheduler.close()
    assert alone and all(forced_on[:alone])
    assert 2 in rows  # they ran together
    assert len(forced_on) > alone and all(forced_on)  # alone again: the fixed path again


def test_seeded_sampled_speculation_over_fixed_shapes_draws_what_plain_sampling_draws(
    engines, model_dirs, registry, forced_on
):
    """A seeded request's draws are fixed by its position keys, so the target's
    distributions over the fixed path must be the ordinary path's for them to agree."""
    from foretell.config import SamplingConfig
    from foretell.plugin import Kind

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = engine.use_draft("two-model", config(model=str(model_dirs["qwen3"])),
                                  max_tokens=3, adaptive=False)
    prompt = [11, 57, 300, 4, 89, 120, 7, 250, 33]
    for seed, temp in ((3, 0.8), (9, 1.2)):
        sampling = SamplingConfig(temp=temp, seed=seed)
        plain = [t for e in engine.generate(prompt, speculate=False, max_tokens=40,
                                            ignore_eos=True, sampling=sampling)
                 for t in getattr(e, "tokens", ())]
        forced_on.clear()
        spec = [t for e in engine.generate(prompt, speculate=speculator, max_tokens=40,
                                           ignore_eos=True, sampling=sampling)
                for t in getattr(e, "tokens", ())]
        assert spec == plain
        assert forced_on and all(forced_on)


def test_a_round_that_traced_a_fixed_forward_is_not_timed(
    engines, model_dirs, registry, forced_on, monkeypatch
):
    """A new window length or capacity traces (on CUDA also compiles): that round's time says
    nothing of what its length costs, so neither the row's policy nor the batch's takes it."""
    from foretell.plugin import Kind
    from foretell.spec.batch_policy import BatchDraftPolicy
    from foretell.spec.warmup import ScriptedPolicy

    monkeypatch.setattr(fixed, "_BY_OWNER", {})  # every shape traces afresh
    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = engine.use_draft("two-model", config(model=str(model_dirs["qwen3"])),
                                  max_tokens=3, adaptive=False)
    told, seen = [], [fixed.trace_count()]

    class Logged(ScriptedPolicy):
        def observe(self, drafted, accepted, seconds, *, one_off=False, fed=False):
            now = fixed.trace_count()
            told.append((one_off, now != seen[-1]))
            seen.append(now)

    batch_told = []
    real = BatchDraftPolicy.observe

    def observed(self, rows, width, seconds):
        if width:
            batch_told.append(seconds is None)
        return real(self, rows, width, seconds)

    monkeypatch.setattr(BatchDraftPolicy, "observe", observed)
    object.__setattr__(speculator, "policy", Logged(3, [3, 2, 3, 2, 3, 3]))
    list(engine.generate([11, 57, 300, 4, 89, 120, 7], speculate=speculator, max_tokens=30,
                         ignore_eos=True))
    assert told[0] == (True, True)  # the first round traced its window
    assert all(one_off == traced for one_off, traced in told)
    assert any(not one_off for one_off, _ in told)  # the rounds after it are timed
    assert [one_off for one_off, _ in told] == batch_told[: len(told)]


def test_fixed_forwards_see_only_whole_capacity_steps_between_ordinary_steps(
    engines, monkeypatch
):
    """Plain steps and a head's chained steps grow a cache by the ordinary path's 256-token
    steps; a fixed forward after them still sees a whole multiple of CAPACITY_STEP, so a
    long generation traces each window length once per step, not once per 256 tokens."""
    model = engines["qwen3"].model
    monkeypatch.setattr(fixed, "CAPACITY_STEP", 512)
    run = fixed.FixedForward(model, _verify, "test forward")
    caches = _prefilled(model, [(3 * i) % 190 + 2 for i in range(250)])
    assert caches[0].keys.shape[2] == 256  # the ordinary path's step
    seen = set()
    for _ in range(40):  # a window of 3, then plain steps, crossing 256, 512 and 768
        run(mx.array([[5, 6, 7]]), caches=caches, length=3)
        seen.add(caches[0].keys.shape[2])
        for _ in range(11):
            model.forward(mx.array([[9]]), caches)
    assert caches[0].offset > 768
    assert seen == {512, 1024}
    assert len(run._traced_shapes) == 2


def test_the_donor_of_a_cloned_prefix_is_never_written(engines):
    model = engines["qwen3"].model
    donor = _prefilled(model, list(range(5, 30)))
    before = [mx.array(c.state[0]) for c in donor]
    clones = [KVCache.from_state(c.state, c.meta) for c in donor]
    run = fixed.FixedForward(model, _verify, "test forward")
    for c in clones:
        c.trim(6)
    out = run(mx.array([[9, 8, 7, 6]]), caches=clones, length=4)
    mx.eval(out)
    for c, b in zip(donor, before):
        assert mx.array_equal(c.state[0], b).item()


def test_a_model_that_needs_more_of_its_caches_falls_back_once_with_a_warning(
    engines, caplog
):
    model = engines["qwen3"].model

    def nosy(owner, window, caches):
        caches[0].trim(1)  # not part of the protocol a fixed forward offers
        return _verify(owner, window, caches)

    run = fixed.FixedForward(model, nosy, "nosy forward")
    caches = _prefilled(model, list(range(3, 14)))
    offsets = [c.offset for c in caches]
    with caplog.at_level(logging.WARNING, logger="foretell.model.fixed"):
        assert run(mx.array([[4, 5]]), caches=caches, length=2) is None
        assert run(mx.array([[4, 5]]), caches=caches, length=2) is None
    assert [c.offset for c in caches] == offsets
    assert run.failed
    assert sum("nosy forward cannot run over fixed shapes" in r.message for r in caplog.records) == 1


def test_caches_that_do_not_qualify_get_none_and_stay_as_they_were(engines):
    model = engines["qwen3"].model
    run = fixed.FixedForward(model, _verify, "test forward")
    caches = _prefilled(model, list(range(3, 14)))
    caches[0].trim(1)  # layers at two offsets
    offsets, shapes = [c.offset for c in caches], [c.keys.shape for c in caches]
    assert run(mx.array([[4, 5]]), caches=caches, length=2) is None
    assert [c.offset for c in caches] == offsets and [c.keys.shape for c in caches] == shapes
    assert not run.failed  # the next qualifying call still takes the fixed path


def test_only_growable_caches_at_one_offset_qualify():
    def written(n):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 2, n, 4)), mx.zeros((1, 2, n, 4)))
        return c

    assert fixed.fits_fixed_shapes([written(3), written(3)])
    assert not fixed.fits_fixed_shapes([written(3), written(4)])
    assert not fixed.fits_fixed_shapes([KVCache()])
    assert not fixed.fits_fixed_shapes([])
    ring = RotatingKVCache(8)
    ring.update_and_fetch(mx.zeros((1, 2, 3, 4)), mx.zeros((1, 2, 3, 4)))
    assert not fixed.fits_fixed_shapes([written(3), ring])


def test_every_verify_window_the_settings_allow_fits_the_fixed_path():
    from foretell.config import DraftSettings

    DraftSettings(num_tokens=16)
    with pytest.raises(ValueError):
        DraftSettings(num_tokens=17)
    assert fixed.MAX_TOKENS >= 16 + 1  # the pending token and the most drafts


def test_forced_sets_the_mode_inside_and_puts_the_processs_back(monkeypatch):
    monkeypatch.setattr(fixed, "_MODE", "off")
    with fixed.forced("on"):
        assert fixed.fixed_shapes_on()
    assert not fixed.fixed_shapes_on()
    with pytest.raises(ValueError, match="'yes'"), fixed.forced("yes"):
        pass
