"""Conformance suites, one per plugin kind, each callable in one line from a plugin's tests.

Every check raises ``AssertionError`` at the first promise the plugin breaks, naming it; a
plugin that does nothing fails. Exported by :mod:`foretell.plugin.testing`:

- :func:`check_draft_provider` (this module): lossless under the verifier through every door
  the provider offers (``open``, plugin API 1; ``open_rows``, plugin API 2), greedy and
  sampled (seeded runs equal plain seeded runs; unseeded, a chi-square against plain
  sampling); commits roll back consistently; captured state restores (through either door).
- :func:`check_cache_codec`: round trips, zero-copy clones, trims.
- :func:`check_architecture`: caches, forward/logits/embed shapes, incremental decoding,
  rollback, ports.
- ``check_storage_layout`` (in :mod:`foretell.plugin.testing`).

Imported through :mod:`foretell.plugin.testing`, which names all four.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Sizes of the tiny target the drafter suite speculates for.
TINY_QWEN = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128}
PROMPTS = ([11, 57, 300, 4, 89, 120, 7, 250, 33, 64, 2, 199],
           [40, 41, 42, 43, 44, 40, 41, 42, 43, 44, 40, 41, 42])


def _registry_with(plugin: Any, name: str) -> Any:
    from foretell.plugin.loader import PluginSwitches, load_plugins

    plugins = load_plugins(switches=PluginSwitches())
    # An installed plugin (the built-ins, an installed distribution) is checked as loaded.
    if name not in {r.name for r in plugins.records} and not plugins.pm.is_registered(plugin):
        record = plugins.register(plugin, name)
        assert record.status == "loaded", f"plugin '{name}' did not load: {record.error}"
    return plugins.registry


def _tokens(events: list[Any]) -> list[int]:
    return [t for e in events[:-1] for t in e.tokens]


def chi_square_p(a: Any, b: Any) -> float:
    """p-value that two count vectors come from one distribution (Wilson-Hilferty tail)."""
    pairs = [(x, y) for x, y in zip(a, b) if x + y > 0]
    if len(pairs) < 2:
        return 1.0
    na, nb = sum(x for x, _ in pairs), sum(y for _, y in pairs)
    stat = sum((x * math.sqrt(nb / na) - y * math.sqrt(na / nb)) ** 2 / (x + y)
               for x, y in pairs)
    df = len(pairs) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def check_draft_provider(plugin: Any, kind: str, options: Any = None, *,
                         model_dir: str | Path | None = None, sampled_runs: int = 120) -> None:
    """Check the draft provider that ``plugin`` (a plugin module or object) registers as
    ``kind``, built with ``options`` (an instance of its config class; None: its defaults),
    against a target: ``model_dir`` or a tiny random Qwen3 made here.

    Checked: greedy speculation emits exactly plain greedy decoding's tokens and the
    provider drafts at all; seeded sampled runs draw exactly plain seeded runs' tokens;
    unseeded, a token's distribution over ``sampled_runs`` requests passes a chi-square
    against plain sampling's (0 skips it); through ``open``, a ``commit`` of fewer tokens
    than drafted leaves the source drafting as a fresh one fed the same sequence does, and
    a captured state restores into a source that drafts the same; through ``open_rows``, a
    batch of rows speculating equals each request decoded plainly alone, and a row's
    captured state restores into a row that drafts the same. ``capture`` may return None
    only for a provider that names no draft identity (no ``draft_identity()``): the tier
    stores the state of the others with cache entries, so theirs must capture.
    """
    import foretell
    from foretell.config import SamplingConfig
    from foretell.spec import make_speculator

    registry = _registry_with(plugin, kind)
    with tempfile.TemporaryDirectory() as scratch:
        if model_dir is None:
            from foretell.tools import make_model_dir

            model_dir = make_model_dir(Path(scratch) / "target", "qwen3", overrides=TINY_QWEN,
                                       registry=registry)
        engine = foretell.load(model_dir, registry=registry)
        speculator = make_speculator(registry, engine.target, kind, options, max_tokens=3,
                                     adaptive=False)
        provider = speculator.provider
        doors = [d for d in ("open", "open_rows") if callable(getattr(provider, d, None))]
        assert doors, f"draft provider '{kind}' has neither open() (plugin API 1) nor " \
                      "open_rows() (plugin API 2)"
        drafted = 0
        for prompt in PROMPTS:
            plain = _tokens(list(engine.generate(prompt, max_tokens=30, ignore_eos=True,
                                                 speculate=False)))
            if "open" in doors:
                events = list(engine.generate(prompt, max_tokens=30, ignore_eos=True,
                                              speculate=speculator))
                assert _tokens(events) == plain, (
                    f"'{kind}': greedy speculation emitted other tokens than plain decoding")
                drafted += events[-1].speculation["drafted"]
            for seed in (1, 2):
                sampling = SamplingConfig(temp=0.8, seed=seed)
                alone = _tokens(list(engine.generate(prompt, max_tokens=16, ignore_eos=True,
                                                     sampling=sampling, speculate=False)))
                if "open" in doors:
                    spoken = _tokens(list(engine.generate(
                        prompt, max_tokens=16, ignore_eos=True, sampling=sampling,
                        speculate=speculator)))
                    assert spoken == alone, f"'{kind}': a seeded sampled run (seed {seed}) " \
                                            "drew other tokens than plain sampling"
        if "open_rows" in doors:
            drafted += _check_rows_door(engine, speculator, kind)
            if not speculator.wants_hidden:  # hidden states by hand: the runs above cover it
                _check_rows_capture(engine, speculator, kind)
        assert drafted > 0, f"'{kind}' never drafted a token: a drafter that proposes " \
                            "nothing only slows decoding down"
        if "open" in doors:
            _check_source_protocol(engine, speculator, kind)
        if sampled_runs:
            _check_unseeded_distribution(engine, speculator, kind, sampled_runs)


def _check_rows_door(engine: Any, speculator: Any, kind: str) -> int:
    from foretell.scheduler import Scheduler

    scheduler = Scheduler(engine)
    try:
        handles = [scheduler.submit(p, max_tokens=20, ignore_eos=True, speculate=speculator)
                   for p in PROMPTS]
        drafted = 0
        for prompt, handle in zip(PROMPTS, handles):
            events = list(handle)
            plain = _tokens(list(engine.generate(prompt, max_tokens=20, ignore_eos=True,
                                                 speculate=False)))
            assert _tokens(events) == plain, (
                f"'{kind}': rows speculating in a batch (open_rows) emitted other tokens than "
                "each request decoded plainly alone")
            drafted += (events[-1].speculation or {}).get("drafted", 0)
    finally:
        scheduler.close()
    return drafted


def _check_source_protocol(engine: Any, speculator: Any, kind: str) -> None:
    from foretell.sampling import Sampler
    from foretell.spec import Draft, Feed

    target, provider = engine.target, speculator.provider
    sampler = Sampler(None)
    prompt = list(PROMPTS[1])

    def opened(tokens: list[int]) -> Any:
        source = provider.open(target, sampler)
        source.prefill(Feed(tokens, _hidden(engine, tokens) if speculator.wants_hidden
                            else None))
        return source

    def proposals(draft: Any) -> list[int]:
        assert isinstance(draft, Draft), f"'{kind}': draft() returned {type(draft).__name__}"
        return draft.tokens[0].tolist()

    if speculator.wants_hidden:
        return  # feeding hidden states by hand is the verifier's job; the runs above cover it
    source = opened(prompt)
    first = proposals(source.draft(Feed([], None, len(prompt)), 3))
    source.commit(0)
    follow = [prompt[-1] if not first else (first[0] + 1) % engine.model.vocab_size]
    again = proposals(source.draft(Feed(follow, None, len(prompt) + 1), 3))
    fresh = opened(prompt + follow)
    assert again == proposals(fresh.draft(Feed([], None, len(prompt) + 1), 3)), (
        f"'{kind}': after commit(0) the source drafts other tokens than a fresh source fed "
        "the same sequence: rejected proposals were not rolled back")
    capture = getattr(source, "capture", None)
    stores_state = _names_draft_identity(provider)
    assert callable(capture) or not stores_state, (
        f"'{kind}' names a draft identity (its state is stored with cache entries) but its "
        "source has no capture()")
    if callable(capture):
        source.commit(0)
        state = _captured(capture(), stores_state, kind, "capture()")
        if state is not None:
            restored = provider.open(target, sampler)
            restored.restore(state, prompt + follow)
            assert proposals(restored.draft(Feed([], None, len(prompt) + 1), 3)) == again, (
                f"'{kind}': a source restored from capture() drafts other tokens than the "
                "source it was captured from")
    source.close()


def _names_draft_identity(provider: Any) -> bool:
    from foretell.spec.contract import CheckpointableProvider

    return isinstance(provider, CheckpointableProvider)


def _captured(state: Any, stores_state: bool, kind: str, what: str) -> Any:
    """``state`` checked: a DraftState, or None only from a provider that names no draft
    identity (the tier never stores such a provider's state, so it may have none)."""
    from foretell.spec import DraftState

    if state is None:
        assert not stores_state, (
            f"'{kind}' names a draft identity (its state is stored with cache entries) but "
            f"{what} returned None between rounds")
        return None
    assert isinstance(state, DraftState), f"'{kind}': {what} returned {type(state).__name__}"
    return state


def _check_rows_capture(engine: Any, speculator: Any, kind: str) -> None:
    """Through ``open_rows``: a row's captured state, given to a new row as ``RowStart.state``,
    makes a row that drafts what the captured one drafts."""
    from foretell.sampling import Sampler
    from foretell.spec import Feed, RowStart

    target, provider = engine.target, speculator.provider
    prompt = list(PROMPTS[1])

    def proposals(draft: Any) -> list[int]:
        return draft.tokens[0, : draft.lengths[0]].tolist()

    rows = provider.open_rows(target)
    rows.append([RowStart(feed=Feed(prompt), sampler=Sampler(None))])
    first = proposals(rows.draft([Feed([], None, len(prompt))], [3]))
    rows.commit([0])
    follow = [prompt[-1] if not first else (first[0] + 1) % engine.model.vocab_size]
    rows.draft([Feed(follow, None, len(prompt) + 1)], [3])
    rows.commit([0])
    held = prompt + follow
    state = _captured(rows.capture(0), _names_draft_identity(provider), kind, "capture(row)")
    following = proposals(rows.draft([Feed([], None, len(held))], [3]))
    rows.close()
    if state is None:
        return
    restored = provider.open_rows(target)
    restored.append([RowStart(feed=Feed(held), sampler=Sampler(None), state=state,
                              state_tokens=held)])
    assert proposals(restored.draft([Feed([], None, len(held))], [3])) == following, (
        f"'{kind}': a row appended with the state capture(row) returned drafts other tokens "
        "than the row it was captured from")
    restored.close()


def _hidden(engine: Any, tokens: list[int]) -> Any:
    from foretell.request import prefill

    return prefill(engine.model, tokens[:-1], engine.make_caches(), keep_hidden=True)


def _check_unseeded_distribution(engine: Any, speculator: Any, kind: str, runs: int) -> None:
    from foretell.config import SamplingConfig

    sampling = SamplingConfig(temp=0.7, top_k=6)
    vocab = engine.model.vocab_size

    def counts(speculate: Any) -> list[list[int]]:
        seen = [[0] * vocab for _ in range(3)]
        for _ in range(runs):
            out = _tokens(list(engine.generate(PROMPTS[0], max_tokens=3, ignore_eos=True,
                                               sampling=sampling, speculate=speculate)))
            for i, token in enumerate(out[:3]):
                seen[i][token] += 1
        return seen

    plain, spoken = counts(False), counts(speculator)
    for i in (1, 2):
        assert chi_square_p(spoken[i], plain[i]) > 1e-4, (
            f"'{kind}': unseeded sampled speculation's token {i + 1} is not distributed as "
            "plain sampling's (chi-square)")


# -- codecs -----------------------------------------------------------------------------------


def check_cache_codec(codec: Any, make_cache: Callable[[], Any],
                      extend: Callable[[Any, int, int], Any] | None = None) -> None:
    """Check a cache codec (an instance) against caches ``make_cache()`` builds.

    ``extend(cache, start, n)`` feeds the cache positions ``start .. start + n - 1`` and
    returns what it hands attention (default: keys and values drawn from the positions
    through ``update_and_fetch``, shape ``[1, 2, n, 8]``), so two caches fed the same
    positions must answer the same. Checked: ``name``/``provider_id``; ``matches`` the kind
    and nothing else; ``snapshot`` meta is JSON; ``load`` gives back a cache that holds the
    same tensors and continues exactly as the original; ``clone`` shares buffers (no copy)
    and neither it nor its donor sees the other's later tokens; where ``header_trimmable``,
    a loaded cache trimmed to ``minimum_reusable_offset`` or beyond continues as a cache fed
    only that prefix.
    """
    import mlx.core as mx

    from foretell.model.kvcache import trim_all

    extend = extend or _kv_extend
    label = f"codec '{getattr(codec, 'name', type(codec).__name__)}'"
    for field in ("name", "provider_id"):
        assert isinstance(getattr(codec, field, None), str) and getattr(codec, field), (
            f"{label}: {field} must be a non-empty string")
    cache = make_cache()
    assert codec.matches(cache) is True, f"{label}: matches() refuses its own cache kind"
    assert not codec.matches(object()), f"{label}: matches() claims an arbitrary object"
    extend(cache, 0, 24)
    tensors, meta = codec.snapshot(cache)
    json.dumps(meta)
    assert tensors, f"{label}: snapshot() of a cache holding 24 tokens returned no tensors"
    loaded = codec.load(tensors, meta)
    assert type(loaded) is type(cache), f"{label}: load() built a {type(loaded).__name__}"
    assert loaded.offset == cache.offset, f"{label}: load() lost the offset"
    again, _ = codec.snapshot(loaded)
    assert set(again) == set(tensors) and all(
        mx.array_equal(again[k], tensors[k]) for k in tensors), (
        f"{label}: a loaded cache's snapshot holds other tensors")
    _same(extend(loaded, 24, 3), extend(cache, 24, 3), f"{label}: a loaded cache continued "
          "differently from the original")

    donor = make_cache()
    extend(donor, 0, 512)
    kept = [a[...] for a in _flat(codec.snapshot(donor)[0])]
    mx.eval(kept)
    before = mx.get_active_memory()
    clone = codec.clone(donor)
    mx.eval(_flat(codec.snapshot(clone)[0]))
    grown = mx.get_active_memory() - before
    held = sum(a.nbytes for a in kept)
    assert grown < held / 2, f"{label}: clone() allocated {grown} bytes for a cache of " \
                             f"{held}: it copies instead of sharing buffers"
    extend(clone, 512, 4)
    after = _flat(codec.snapshot(donor)[0])
    assert len(after) == len(kept) and all(mx.array_equal(a, b) for a, b in zip(after, kept)), (
        f"{label}: extending a clone changed its donor")

    if codec.header_trimmable(meta):
        floor = codec.minimum_reusable_offset(meta)
        assert 0 <= floor <= cache.offset, f"{label}: minimum_reusable_offset outside 0..offset"
        cut = max(floor, 10)
        trimmed = codec.load(tensors, meta)
        assert trim_all([trimmed], 24 - cut) == 24 - cut, \
            f"{label}: a cache whose meta says it trims did not trim"
        short = make_cache()
        extend(short, 0, cut)
        _same(extend(trimmed, cut, 3), extend(short, cut, 3),
              f"{label}: a trimmed cache continued differently from one fed only the prefix")


def _flat(tensors: dict[str, Any]) -> list[Any]:
    return [tensors[k] for k in sorted(tensors)]


def _same(a: Any, b: Any, message: str) -> None:
    import mlx.core as mx

    a, b = (a if isinstance(a, (list, tuple)) else [a]), (b if isinstance(b, (list, tuple)) else [b])
    assert len(a) == len(b) and all(
        x.shape == y.shape and mx.allclose(x, y) for x, y in zip(a, b)), message


def _kv_extend(cache: Any, start: int, n: int) -> Any:
    import mlx.core as mx

    positions = mx.arange(start, start + n, dtype=mx.float32)
    keys = mx.sin(positions[None, None, :, None] * mx.arange(1, 9, dtype=mx.float32) / 7)
    keys = mx.concatenate([keys, keys * 2], axis=1)
    return cache.update_and_fetch(keys, keys + 1)


# -- architectures ----------------------------------------------------------------------------


def check_architecture(plugin: Any, model_type: str, *, overrides: dict[str, Any] | None = None,
                       ) -> None:
    """Check the architecture ``plugin`` registers as ``model_type``, on a tiny random
    checkpoint its synthetic spec describes (``register(..., synthetic=...)``; ``overrides``
    change its config).

    Checked: the model loads through foretell's loader; ``model_type``, ``vocab_size`` and
    ``capabilities``; ``make_caches`` gives empty caches with an ``offset``; ``forward``
    returns ``[1, L, H]`` states and logits ``[1, L, vocab]``, finite; decoding one token at a
    time through the caches gives the logits of one forward over all of them; a rollback
    (``trim``) of the last tokens leaves caches that continue as ones fed only the kept
    prefix; ``embed`` gives ``[1, L, ...]``; with the ``taps`` port, the asked layers' states.
    """
    import mlx.core as mx

    from foretell.model.contract import PORT_TAPS
    from foretell.model.kvcache import trim_all
    from foretell.model.loading import load_model
    from foretell.tools import make_model_dir

    registry = _registry_with(plugin, model_type)
    label = f"architecture '{model_type}'"
    with tempfile.TemporaryDirectory() as scratch:
        path = make_model_dir(Path(scratch) / "model", model_type, overrides=overrides,
                              registry=registry)
        model = load_model(path, registry)
    assert model.model_type == model_type, f"{label}: model_type is {model.model_type!r}"
    assert isinstance(model.vocab_size, int) and model.vocab_size > 0, f"{label}: vocab_size"
    assert isinstance(model.capabilities, frozenset), f"{label}: capabilities must be a frozenset"
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]], dtype=mx.int32) % model.vocab_size
    caches = model.make_caches()
    assert isinstance(caches, list) and caches, f"{label}: make_caches() gave no caches"
    assert all(c.offset == 0 for c in caches), f"{label}: fresh caches hold tokens"
    whole, taps = model.forward(tokens, model.make_caches())
    assert taps == {}, f"{label}: forward() without taps returned taps"
    assert whole.ndim == 3 and whole.shape[:2] == (1, 8), f"{label}: forward() gave {whole.shape}"
    logits = model.logits(whole)
    assert logits.shape == (1, 8, model.vocab_size), f"{label}: logits() gave {logits.shape}"
    assert bool(mx.all(mx.isfinite(logits))), f"{label}: logits are not finite"
    steps = [model.forward(tokens[:, :5], caches)[0]]
    steps += [model.forward(tokens[:, i : i + 1], caches)[0] for i in range(5, 8)]
    stepped = model.logits(mx.concatenate(steps, axis=1))
    assert mx.allclose(stepped, logits, atol=1e-3, rtol=1e-3), (
        f"{label}: decoding through the caches gives other logits than one forward")
    assert all(c.offset == 8 for c in caches), f"{label}: caches do not count 8 tokens"
    assert trim_all(caches, 3) == 3, f"{label}: its caches did not roll back 3 tokens"
    fresh = model.make_caches()
    model.forward(tokens[:, :5], fresh)
    nxt = mx.array([[7]], dtype=mx.int32)
    assert mx.allclose(model.logits(model.forward(nxt, caches)[0]),
                       model.logits(model.forward(nxt, fresh)[0]), atol=1e-3, rtol=1e-3), (
        f"{label}: rolled-back caches continue differently from caches fed only the prefix")
    embedded = model.embed(tokens)
    assert embedded.shape[:2] == (1, 8), f"{label}: embed() gave {embedded.shape}"
    if PORT_TAPS in model.capabilities:
        _, tapped = model.forward(tokens, model.make_caches(), taps=(0,))
        assert set(tapped) == {0} and tapped[0].shape[:2] == (1, 8), (
            f"{label}: offers the taps port but forward(taps=(0,)) gave {sorted(tapped)}")
