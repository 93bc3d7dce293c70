"""Adapted models in foretell's batch scheduler: their batch caches are mlx-lm's own (merged
from each row's single caches, left-padded), so every row computes what it computes alone,
whatever joins and leaves beside it; a batch whose rows cannot roll back apart decodes them
plainly; a model mlx-lm cannot batch fails its requests with an error naming it."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_speculation import _perturbed
from test_zoo import BROKEN_IN_MLX_LM, NEEDS_METAL

from foretell.errors import GenerationError
from foretell.plugin import Kind
from foretell.scheduler import Scheduler
from foretell_mlxlm import zoo
from foretell_mlxlm.adapter import Adapted
from foretell_mlxlm.batch import UNBATCHED

#: Modules with a layer kind mlx-lm has no batch for, and that kind.
UNMERGEABLE = {"llama4": "MlxLmChunkedKVCache", "deepseek_v41": "MlxLmLayerCache"}

PROMPTS = [[3, 9, 27, 81, 24, 5], [7, 1, 44, 2, 19, 100, 31, 8, 12, 6], [11]]
#: Step at which each row of :data:`PROMPTS` joins; each leaves after ``STEPS`` steps.
JOINS = {0: 0, 1: 2, 2: 3}
STEPS = 8


def _continued(prompt: list[int]) -> list[int]:
    """``prompt`` and the tokens fed after it (fixed, so rows compare position by position)."""
    return prompt + [(prompt[-1] * 7 + 13 * i) % 400 + 1 for i in range(3 * STEPS)]


def _alone(model, sequence: list[int], prompt: int) -> list[mx.array]:
    """Logits after each token of ``sequence`` from its prompt's last one on, the prompt's
    others prefilled in one forward and the rest fed one at a time (as decoding does)."""
    caches = model.make_caches()
    if prompt > 1:
        model.forward(mx.array([sequence[: prompt - 1]]), caches)
    out = []
    for token in sequence[prompt - 1 :]:
        hidden, _ = model.forward(mx.array([[token]]), caches)
        out.append(model.logits(hidden[:, -1])[0])
    return out


def _batched_matches_alone(model, window: int) -> None:
    """Rows of :data:`PROMPTS` joining at :data:`JOINS` feed ``window`` tokens a step; row
    ``b`` keeps ``1 + (b + step) % window`` of them and trims the rest (a verify window's
    ragged acceptance). Each kept position's logits are the row's alone; a leaving row's
    extracted caches hold its tokens and continue as its own would."""
    from foretell.model.batch import batch_caches

    sequences = [_continued(p) for p in PROMPTS]
    want = [_alone(model, s, len(p)) for s, p in zip(sequences, PROMPTS)]
    batch = batch_caches(model)
    rows: list[int] = []  # row index into PROMPTS, in batch order
    held: dict[int, int] = {}  # tokens each row's caches hold
    steps: dict[int, int] = {}
    for step in range(max(JOINS.values()) + STEPS + 1):
        for r in [r for r, at in JOINS.items() if at == step]:
            caches = model.make_caches()
            if len(PROMPTS[r]) > 1:
                model.forward(mx.array([PROMPTS[r][:-1]]), caches)
            for layer, cache in enumerate(batch):
                cache.append([caches[layer]])
            rows.append(r)
            held[r], steps[r] = len(PROMPTS[r]) - 1, 0
        if not rows:
            continue
        tokens = mx.array([sequences[r][held[r] : held[r] + window] for r in rows])
        hidden, _ = model.forward(tokens, batch)
        logits = model.logits(hidden)
        kept = [1 + (r + step) % window for r in rows]
        for b, (r, k) in enumerate(zip(rows, kept)):
            for i in range(k):
                position = held[r] + i - (len(PROMPTS[r]) - 1)
                assert mx.allclose(logits[b, i], want[r][position], atol=1e-4), (
                    f"row {r} position {position}: max difference "
                    f"{float(mx.abs(logits[b, i] - want[r][position]).max())}")
        for cache in batch:
            cache.trim([window - k for k in kept])
        for r, k in zip(rows, kept):
            held[r] += k
            steps[r] += 1
        assert all(cache.lengths == [held[r] for r in rows] for cache in batch)
        if window > 1:  # rows rolled back apart pad no slot all of them pad
            assert {cache.cache._idx for cache in batch} == {max(held[r] for r in rows)}
        leaving = [b for b, r in enumerate(rows) if steps[r] == STEPS]
        for b in leaving:
            r = rows[b]
            caches = [cache.extract(b) for cache in batch]
            assert [c.offset for c in caches] == [held[r]] * len(caches)
            hidden, _ = model.forward(mx.array([[sequences[r][held[r]]]]), caches)
            position = held[r] - (len(PROMPTS[r]) - 1)
            assert mx.allclose(model.logits(hidden[:, -1])[0], want[r][position], atol=1e-4)
        if leaving:
            keep = [b for b in range(len(rows)) if b not in leaving]
            for cache in batch:
                cache.filter(keep)
            rows = [rows[b] for b in keep]
    assert not rows


def _batchable():
    metal = mx.metal.is_available()
    for module in zoo.modules():
        reason = (BROKEN_IN_MLX_LM.get(module) or (None if metal else NEEDS_METAL.get(module))
                  or UNBATCHED.get(module) or UNMERGEABLE.get(module))
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        yield pytest.param(module, marks=marks, id=module)


def _adapted(registry, model_dir, model_type):
    from foretell.model.loading import load_model

    served = registry.get(Kind.ARCHITECTURE, model_type)
    if served.origin.plugin != "mlxlm":
        pytest.skip(f"served natively by plugin '{served.origin.plugin}'")
    return load_model(model_dir(model_type), registry)


@pytest.mark.parametrize("model_type", list(_batchable()))
def test_rows_joining_and_leaving_a_batch_compute_what_each_computes_alone(
        registry, model_dir, model_type):
    model = _adapted(registry, model_dir, model_type)
    _batched_matches_alone(model, window=1)


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "deepseek_v3", "pixtral"])
def test_kv_rows_roll_back_apart_after_a_verify_window(registry, model_dir, model_type):
    from foretell.model.batch import batch_caches

    model = _adapted(registry, model_dir, model_type)
    assert batch_caches(model)[0].trims_rows
    _batched_matches_alone(model, window=3)


@pytest.mark.parametrize("model_type", ["qwen3_next", "cohere2", "mamba", "gemma3"])
def test_a_batch_with_recurrent_or_ring_layers_says_its_rows_cannot_roll_back_apart(
        registry, model_dir, model_type):
    from foretell.model.batch import batch_caches

    model = _adapted(registry, model_dir, model_type)
    batch = batch_caches(model)
    assert not any(cache.trims_rows for cache in batch)
    caches = model.make_caches()
    model.forward(mx.array([[1, 2, 3]]), caches)
    for cache in batch:
        cache.append([caches[batch.index(cache)], caches[batch.index(cache)]])
    model.forward(mx.array([[4, 5], [6, 7]]), batch)
    with pytest.raises(GenerationError, match="cannot drop"):
        for cache in batch:
            cache.trim([1, 0])


@pytest.mark.parametrize("model_type", sorted(UNMERGEABLE))
def test_a_layer_mlx_lm_cannot_merge_is_refused_naming_the_type_and_layer(
        registry, model_dir, model_type):
    from foretell.model.batch import batch_caches

    model = _adapted(registry, model_dir, model_type)
    with pytest.raises(TypeError, match=f"{model_type}: a batch cannot hold a "
                                        f"{UNMERGEABLE[model_type]} layer"):
        batch_caches(model)


@pytest.mark.parametrize("model_type", sorted(UNBATCHED))
def test_a_module_mlx_lm_cannot_batch_is_refused_and_mlx_lm_itself_fails_it(
        registry, model_dir, model_type):
    """The reason still holds: mlx-lm's own forward over its own merged caches of rows of
    different lengths (one of them a one-token prompt, joining with empty caches) fails or
    computes otherwise than each row alone."""
    from mlx_lm.models.cache import make_prompt_cache

    from foretell.model.batch import batch_caches

    model = _adapted(registry, model_dir, model_type)
    with pytest.raises(TypeError, match=f"{model_type}: a batch cannot hold this model"):
        batch_caches(model)
    lm_forward = super(Adapted, model).__call__

    def prefilled():
        singles = []
        for prompt in PROMPTS:
            own = make_prompt_cache(model)
            if len(prompt) > 1:
                lm_forward(mx.array([prompt[:-1]]), cache=own)
            singles.append(own)
        return singles

    alone = [lm_forward(mx.array([[p[-1]]]), cache=own)[0, -1]
             for p, own in zip(PROMPTS, prefilled())]
    singles = prefilled()
    merged = [type(c).merge([s[i] for s in singles]) for i, c in enumerate(singles[0])]
    try:
        together = lm_forward(mx.array([[p[-1]] for p in PROMPTS]), cache=merged)[:, -1]
        mx.eval(together)
    except ValueError:
        return
    assert not all(mx.allclose(together[b], alone[b], atol=1e-3) for b in range(len(PROMPTS)))


# -- through the scheduler ------------------------------------------------------------------

TEXTS = [[5, 17, 29, 41, 53, 65, 77], [200, 3, 99, 14, 150, 61, 8, 240, 33, 70, 12, 4, 90],
         [31, 62], [7]]
LENGTHS = [20, 9, 14, 11]


def _tokens(events) -> tuple[list[int], object]:
    events = list(events)
    return [t for e in events if e.type == "text" for t in e.tokens], events[-1]


@pytest.fixture(scope="module")
def engines(registry, model_dir):
    import foretell

    made = {}

    def engine(model_type):
        if model_type not in made:
            made[model_type] = foretell.load(model_dir(model_type), registry=registry)
        return made[model_type]

    return engine


@pytest.mark.parametrize("model_type", ["llama", "cohere2", "qwen3_next"])
def test_scheduled_rows_joining_at_different_times_stream_what_each_streams_alone(
        engines, model_type):
    engine = engines(model_type)
    scheduler = Scheduler(engine)
    started = []
    for prompt, n in zip(TEXTS, LENGTHS):
        events = iter(scheduler.submit(prompt, max_tokens=n, ignore_eos=True))
        started.append([next(events), events])  # this row decodes before the next joins
    for prompt, n, (first, events) in zip(TEXTS, LENGTHS, started):
        tokens, stats = _tokens([first, *events])
        alone, _ = _tokens(engine.generate(prompt, max_tokens=n, ignore_eos=True,
                                           speculate=False))
        assert tokens == alone
        assert stats.generated_tokens == n
    scheduler.close()


@pytest.mark.parametrize("model_type", ["llama", "qwen3_next"])
def test_what_a_batched_row_stores_serves_the_next_turn(registry, model_dir, model_type):
    """A row's caches extracted from the batch go to the cache tier as the adapted caches
    the model builds, and serve a continuation of its conversation."""
    import foretell
    from foretell.cache.codecs import load_codecs
    from foretell.cache.tier import CacheTier

    engine = foretell.load(model_dir(model_type), registry=registry)
    first, _ = _tokens(engine.generate(TEXTS[1], max_tokens=10, ignore_eos=True,
                                       speculate=False))
    turn = [*TEXTS[1], *first, 42, 43]
    want, _ = _tokens(engine.generate(turn, max_tokens=8, ignore_eos=True, speculate=False))
    engine.cache = CacheTier(load_codecs(registry))
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=10, ignore_eos=True) for p in TEXTS[:2]]
    assert _tokens(handles[1])[0] == first
    _tokens(handles[0])
    tokens, stats = _tokens(scheduler.submit(turn, max_tokens=8, ignore_eos=True))
    assert tokens == want
    assert stats.cached_tokens >= len(TEXTS[1]) + len(first) - 1
    scheduler.close()


def _two_model(engine, registry, draft_dir, max_tokens=3):
    from foretell.spec import make_speculator

    options = registry.get(Kind.DRAFT, "two-model").config(model=str(draft_dir))
    return make_speculator(registry, engine.target, "two-model", options,
                           max_tokens=max_tokens, adaptive=False)


def test_a_drafting_row_on_a_batch_that_cannot_roll_back_apart_runs_alone_and_speculates(
        engines, registry, model_dir):
    """A batch's recurrent state cannot drop one row's rejected drafts; the request's own
    (journaled) caches can: the scheduler runs it alone, then the others batch on."""
    engine = engines("qwen3_next")  # its recurrent state cannot drop a row's rejected drafts
    speculator = _two_model(engine, registry, model_dir("llama"))  # a draft that can
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(TEXTS[0], max_tokens=16, ignore_eos=True,
                                speculate=speculator),
               scheduler.submit(TEXTS[1], max_tokens=16, ignore_eos=True, speculate=False)]
    stats = []
    for prompt, handle in zip(TEXTS, handles):
        tokens, ended = _tokens(handle)
        assert tokens == _tokens(engine.generate(prompt, max_tokens=16, ignore_eos=True,
                                                 speculate=False))[0]
        stats.append(ended)
    assert stats[0].speculation["drafted"] > 0, stats[0].speculation
    scheduler.close()


def test_rows_of_an_adapted_kv_model_speculate_in_a_batch_and_keep_each_accepted_prefix(
        engines, registry, model_dir, tmp_path_factory):
    engine = engines("llama")
    speculator = _two_model(engine, registry, _perturbed(
        model_dir("llama"), tmp_path_factory.mktemp("llama-draft")))
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=24, ignore_eos=True, speculate=speculator)
               for p in TEXTS]
    drafted = accepted = 0
    for prompt, handle in zip(TEXTS, handles):
        tokens, stats = _tokens(handle)
        assert tokens == _tokens(engine.generate(prompt, max_tokens=24, ignore_eos=True,
                                                 speculate=False))[0]
        drafted += stats.speculation["drafted"]
        accepted += stats.speculation["accepted"]
    assert 0 < accepted < drafted  # rows kept different counts and were rolled back apart
    scheduler.close()


def test_a_draft_model_whose_rows_cannot_roll_back_apart_leaves_its_row_decoding_plainly(
        engines, registry, model_dir):
    engine = engines("llama")
    speculator = _two_model(engine, registry, model_dir("qwen3_next"))
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=12, ignore_eos=True, speculate=speculator)
               for p in TEXTS[:2]]
    for prompt, handle in zip(TEXTS, handles):
        tokens, stats = _tokens(handle)
        assert tokens == _tokens(engine.generate(prompt, max_tokens=12, ignore_eos=True,
                                                 speculate=False))[0]
        assert stats.speculation is None
    scheduler.close()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt``, decoded one forward a token with its own caches."""
    caches, out = model.make_caches(), []
    if len(prompt) > 1:
        model.forward(mx.array([prompt[:-1]]), caches)
    token = prompt[-1]
    for _ in range(n):
        hidden, _ = model.forward(mx.array([[token]]), caches)
        token = int(mx.argmax(model.logits(hidden[:, -1])[0]).item())
        out.append(token)
    return out


def test_requests_for_a_model_no_batch_holds_run_one_at_a_time(engines):
    """No batch holds llama4's chunked-attention caches: the scheduler runs its requests one
    after another through its own caches, each giving what it gives alone."""
    engine = engines("llama4")
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=6, ignore_eos=True) for p in TEXTS[:2]]
    for prompt, handle in zip(TEXTS, handles):
        assert _tokens(handle)[0] == _greedy(engine.model, prompt, 6)
    assert scheduler._solo
    scheduler.close()
