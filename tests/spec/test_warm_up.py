"""On a device that compiles kernels per shape (CUDA), preparing a speculator runs whole
rounds of every draft length, greedy and sampled, before any request, on a throwaway copy:
the speculator's own policy learns nothing from it and the cache tier stores nothing.
Elsewhere preparing runs nothing extra."""

from __future__ import annotations

from foretell.cache.tier import CacheTier
from foretell.spec import acceptance, warmup
from foretell.spec.policy import PLAIN_STRETCH


def _prepare(engine, monkeypatch, cuda: bool, kind: str = "ngram", max_tokens: int = 5,
             sampled_requests: bool = True):
    """Prepare ``kind`` with the device said to compile per shape (or not), then stop
    speculating; returns the speculator, the target forwards' window lengths and the
    rejection-sampling calls' draft lengths seen while preparing."""
    lengths, sampled = [], []
    forward, accept = engine.model.forward, acceptance.accept_or_resample

    def counting(tokens, caches, *args, **kwargs):
        lengths.append(tokens.shape[1])
        return forward(tokens, caches, *args, **kwargs)

    def counting_accept(p, drafts, *rest):
        sampled.append(drafts.shape[1])
        return accept(p, drafts, *rest)

    monkeypatch.setattr(warmup, "compiles_per_shape", lambda: cuda)
    monkeypatch.setattr(engine.model, "forward", counting)
    monkeypatch.setattr(acceptance, "accept_or_resample", counting_accept)
    try:
        speculator = engine.use_draft(kind, max_tokens=max_tokens, sampled=sampled_requests)
    finally:
        monkeypatch.undo()
        engine.use_draft(None)
    return speculator, lengths, sampled


def test_a_compiling_device_runs_rounds_of_every_length_greedy_and_sampled(engines, monkeypatch):
    speculator, lengths, sampled = _prepare(engines["qwen3"], monkeypatch, cuda=True)
    assert {n - 1 for n in lengths if n > 1} >= {1, 2, 3, 4, 5}  # verify windows [pending, k drafts]
    # (A sampled row's plain step in a verify forward judges an empty draft: length 0.)
    assert set(sampled) - {0} == {1, 2, 3, 4, 5}
    assert speculator.policy._rounds == 0  # the warm-up's rounds ran on its own policy


def test_a_speculator_for_greedy_requests_only_warms_no_sampled_rounds(engines, monkeypatch):
    speculator, lengths, sampled = _prepare(engines["qwen3"], monkeypatch, cuda=True,
                                            sampled_requests=False)
    assert {n - 1 for n in lengths if n > 1} >= {1, 2, 3, 4, 5}
    assert sampled == [] and speculator.sampled is False


def test_warming_stores_nothing_in_the_engines_cache(engines, monkeypatch, tmp_path):
    engine = engines["qwen3"]
    engine.cache = tier = CacheTier.for_engine(engine, None)
    try:
        _prepare(engine, monkeypatch, cuda=True, max_tokens=2)
        assert engine.cache is tier and len(tier.ram.entries()) == 0
    finally:
        engine.cache = None


def test_other_devices_prepare_without_extra_forwards(engines, monkeypatch):
    _speculator, lengths, sampled = _prepare(engines["qwen3"], monkeypatch, cuda=False)
    assert lengths == [] and sampled == []


def test_generation_after_warming_is_unchanged(engines, monkeypatch):
    engine = engines["qwen3"]
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    plain = [t for e in engine.generate(prompt, max_tokens=24, speculate=False)
             if e.type == "text" for t in e.tokens]
    monkeypatch.setattr(warmup, "compiles_per_shape", lambda: True)
    spec = engine.use_draft("ngram", max_tokens=5)
    try:
        out = [t for e in engine.generate(prompt, max_tokens=24, speculate=spec)
               if e.type == "text" for t in e.tokens]
    finally:
        engine.use_draft(None)
    assert out == plain


def test_the_warm_up_switches_back_to_drafting_after_plain_stretches(engines, monkeypatch):
    """The drafter hears of each plain stretch in one feed when drafting resumes (a model
    drafter's catch-up forward, a shape no fixed-length round makes): feeds as long as each
    scripted stretch reach it while preparing."""
    from foretell_ngram.lookup import NgramRows

    feeds = []
    real_draft = NgramRows.draft

    def recording(rows, row_feeds, lengths):
        feeds.extend(len(feed.tokens) for feed, n in zip(row_feeds, lengths) if n)
        return real_draft(rows, row_feeds, lengths)

    monkeypatch.setattr(NgramRows, "draft", recording)
    speculator, _lengths, _sampled = _prepare(engines["qwen3"], monkeypatch, cuda=True, max_tokens=3)
    # One long feed per stretch (within a few tokens of its length), the longest near the
    # longest stretch.
    long = [f for f in feeds if f > PLAIN_STRETCH]
    assert len(long) >= len(warmup.SWITCH_BACKS), feeds
    assert max(long) >= (max(warmup.SWITCH_BACKS) - 1) * PLAIN_STRETCH, feeds
    assert speculator.policy._rounds == 0


def test_the_switch_backs_run_past_the_first_capacity_step(engines, monkeypatch):
    """Past 1,024 tokens the fixed-shape forwards run over a larger buffer (a new trace per
    window length) and a draft model first reads more than 1,024 keys: the warm-up's
    scripted request gets there, drafting and decoding plainly."""
    from foretell.model.fixed import CAPACITY_STEP

    reached = []
    forward = engines["qwen3"].model.forward

    def tracking(tokens, caches, *args, **kwargs):
        reached.append((caches[0].offset + tokens.shape[1], tokens.shape[1]))
        return forward(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(engines["qwen3"].model, "forward", tracking)
    _prepare(engines["qwen3"], monkeypatch, cuda=True, max_tokens=2)
    past = [length for end, length in reached if end > CAPACITY_STEP]
    assert 1 in past and 3 in past  # plain steps and verify windows of [pending, 2 drafts]


def test_the_scripted_policy_follows_its_script_within_the_limit():
    policy = warmup.ScriptedPolicy(4, [4, 0, 0, 2])
    assert [policy.choose(3), policy.choose(9), policy.choose(9), policy.choose(1)] == [3, 0, 0, 1]
    policy.observe(4, 4, 1.0)
    assert policy.choose(9) == 4  # the script ran out: max_k


def test_the_warm_up_reports_its_progress_to_the_end(engines, monkeypatch):
    calls = []
    monkeypatch.setattr(warmup, "compiles_per_shape", lambda: True)
    try:
        engines["qwen3"].use_draft("ngram", max_tokens=3, progress=lambda d, t: calls.append((d, t)))
    finally:
        engines["qwen3"].use_draft(None)
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
