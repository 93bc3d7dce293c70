"""Draft-side state composes with the cache tier: the drafter's state is stored with the
target's entry (an attachment under the draft artifact's identity) and restored with it, on
a RAM hit, an SSD hit in a fresh engine and ``--resume``, so the drafter does not prefill
the cached prefix; output stays token-identical to plain greedy decoding and to an
uninterrupted run; a sampled speculative run resumes on the same seeded draws. Another draft
model's state, and an entry served shorter than it holds, are never restored."""

from __future__ import annotations

import random

import pytest

import foretell
from foretell.cache.tier import CacheTier
from foretell.config import SamplingConfig
from foretell.plugin import Kind

PROMPT = [random.Random(3).randrange(1, 500) for _ in range(40)]
# Repetitive, so prompt lookup and the draft models find something to propose.
PROMPT_REPEATS = [40, 41, 42, 43, 44, 45] * 5 + [40, 41]
MAX_TOKENS = 24


class Spy:
    """Counts what reaches a drafter's rows class as rows join: tokens prefilled (those past
    a restored state) and restores with the tokens each state had been fed."""

    def __init__(self, monkeypatch, cls):
        self.prefilled: list[int] = []
        self.restored: list[int] = []
        spy = self
        append = cls.append

        def counting_append(rows, starts):
            for start in starts:
                if start.state is not None:
                    spy.restored.append(len(start.state_tokens))
                spy.prefilled.append(len(start.feed.tokens) - len(start.state_tokens)
                                     if start.state is not None else len(start.feed.tokens))
            return append(rows, starts)

        monkeypatch.setattr(cls, "append", counting_append)

    def reset(self):
        self.prefilled.clear()
        self.restored.clear()


def rows_class(kind):
    """The class of the rows a drafter serves requests with (its ``open_rows``)."""
    if kind == "two-model":
        from foretell_two_model.rows import TwoModelRows

        return TwoModelRows
    if kind == "mtp":
        from foretell_qwen.mtp_rows import MTPRows

        return MTPRows
    from foretell_ngram.lookup import NgramRows

    return NgramRows


def drafter(registry, kind, **options):
    config = registry.get(Kind.DRAFT, kind).config
    return kind, (config(**options) if config is not None else None)


def engine_with(path, registry, draft, cache_dir=None, k=3):
    engine = foretell.load(path, registry=registry)
    engine.cache = CacheTier.for_engine(engine, cache_dir)
    engine.use_draft(*draft, max_tokens=k, adaptive=False)
    return engine


def run(engine, prompt, **options):
    events = list(engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **options))
    return [t for e in events[:-1] for t in e.tokens], events[-1]


def plain(path, registry, prompt, **options):
    return run(foretell.load(path, registry=registry), prompt, speculate=False, **options)[0]


def drafters(model_dirs, registry, target="qwen3"):
    return {
        # Self-drafting: the draft model's caches are the target's kind (a Gemma draft's
        # sliding windows included), and it is accepted, so bursts are exercised.
        "two-model": drafter(registry, "two-model", model=str(model_dirs[target])),
        "ngram": drafter(registry, "ngram", max_ngram=3),
    }


@pytest.mark.parametrize("target", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("kind", ["two-model", "ngram"])
def test_a_ram_hit_restores_the_drafter_instead_of_prefilling_it(
        model_dirs, registry, monkeypatch, kind, target):
    spy = Spy(monkeypatch, rows_class(kind))
    engine = engine_with(model_dirs[target], registry, drafters(model_dirs, registry, target)[kind])
    first, cold = run(engine, PROMPT_REPEATS)
    assert spy.prefilled == [len(PROMPT_REPEATS)] and spy.restored == []
    spy.reset()
    again, warm = run(engine, PROMPT_REPEATS)
    assert warm.cached_from == "ram" and warm.cached_tokens == len(PROMPT_REPEATS) - 1
    # The drafter came back from the entry; nothing of the prompt was prefilled again.
    assert spy.restored == [len(PROMPT_REPEATS)] and spy.prefilled == [0]
    assert again == first == plain(model_dirs[target], registry, PROMPT_REPEATS)
    assert warm.speculation["accepted"] > 0
    assert (cold.speculation["draft_cached_tokens"],
            warm.speculation["draft_cached_tokens"]) == (0, len(PROMPT_REPEATS))


def test_the_two_model_drafter_computes_only_what_the_cache_lacks(model_dirs, registry,
                                                                   monkeypatch):
    """Counted at the draft model itself: a hit skips the cached prefix draft-side too."""
    engine = engine_with(model_dirs["qwen3"], registry, drafters(model_dirs, registry)["two-model"])
    draft_model = engine.speculator.provider.model
    computed = []
    forward = type(draft_model).forward

    def counting_forward(model, tokens, caches, *args, **kwargs):
        if model is draft_model:
            computed.append(tokens.shape[1])
        return forward(model, tokens, caches, *args, **kwargs)

    monkeypatch.setattr(type(draft_model), "forward", counting_forward)
    run(engine, PROMPT)
    cold = sum(computed)
    computed.clear()
    run(engine, PROMPT)
    assert sum(computed) <= cold - (len(PROMPT) - 1)


@pytest.mark.parametrize("kind", ["two-model", "ngram"])
def test_an_ssd_hit_in_a_fresh_engine_restores_the_drafter(model_dirs, registry, monkeypatch,
                                                           tmp_path, kind):
    draft = drafters(model_dirs, registry)[kind]
    writer = engine_with(model_dirs["qwen3"], registry, draft, tmp_path)
    original, _ = run(writer, PROMPT_REPEATS)
    assert writer.cache.close(10).durable
    spy = Spy(monkeypatch, rows_class(kind))
    restored, stats = run(engine_with(model_dirs["qwen3"], registry, draft, tmp_path),
                          PROMPT_REPEATS)
    assert stats.cached_from == "ssd"
    assert spy.restored == [len(PROMPT_REPEATS)] and spy.prefilled == [0]
    assert restored == original == plain(model_dirs["qwen3"], registry, PROMPT_REPEATS)


def test_another_draft_models_state_is_never_restored(model_dirs, registry, monkeypatch):
    spy = Spy(monkeypatch, rows_class("two-model"))
    engine = engine_with(model_dirs["qwen3"], registry,
                         drafter(registry, "two-model", model=str(model_dirs["qwen3"])))
    run(engine, PROMPT)
    # Same target, same namespace (two-model), another draft model: the target's KV is
    # reused, the stored draft caches (the other model's) are not.
    engine.use_draft(*drafter(registry, "two-model", model=str(model_dirs["qwen3-other"])),
                     max_tokens=3, adaptive=False)
    spy.reset()
    tokens, stats = run(engine, PROMPT)
    assert stats.cached_from == "ram" and stats.cached_tokens == len(PROMPT) - 1
    assert spy.restored == [] and spy.prefilled == [len(PROMPT)]
    assert tokens == plain(model_dirs["qwen3"], registry, PROMPT)


def test_a_shorter_prefix_hit_never_uses_the_attachment(model_dirs, registry, monkeypatch):
    spy = Spy(monkeypatch, rows_class("two-model"))
    engine = engine_with(model_dirs["qwen3"], registry, drafters(model_dirs, registry)["two-model"])
    run(engine, PROMPT)
    other = PROMPT[:20] + [7, 8, 9, 10, 11]
    spy.reset()
    tokens, stats = run(engine, other)
    assert stats.cached_tokens == 20  # the entry served trimmed: its drafter state is stale
    assert spy.restored == [] and spy.prefilled == [len(other)]
    assert tokens == plain(model_dirs["qwen3"], registry, other)


def test_a_prompt_continuing_the_last_request_restores_then_prefills_the_rest(
        model_dirs, registry, monkeypatch):
    """The entry stored when a request ends carries the drafter too: a prompt that goes on
    from everything the last request produced (a next turn that renders it as it was)."""
    spy = Spy(monkeypatch, rows_class("two-model"))
    engine = engine_with(model_dirs["qwen3"], registry, drafters(model_dirs, registry)["two-model"])
    first, _ = run(engine, PROMPT)
    longer = [*PROMPT, *first, 3, 1, 4, 1, 5]
    spy.reset()
    tokens, stats = run(engine, longer)
    assert stats.cached_tokens == len(PROMPT) + len(first) - 1
    # Restored with what it had seen; fed only the tokens it had not.
    assert len(spy.restored) == 1 and spy.restored[0] >= len(PROMPT)
    assert spy.prefilled == [len(longer) - spy.restored[0]]
    assert tokens == plain(model_dirs["qwen3"], registry, longer)


def test_an_entry_with_drafter_state_is_not_displaced_by_a_longer_one(model_dirs, registry):
    engine = engine_with(model_dirs["qwen3"], registry, drafters(model_dirs, registry)["ngram"])
    run(engine, PROMPT)
    entries = {len(e.tokens): e for e in engine.cache.ram.entries()}
    # The prompt snapshot survives the longer prompt + generation entry (both attached).
    assert len(PROMPT) - 1 in entries and len(entries) == 2
    assert all(e.attached for e in entries.values())


# -- MTP on the shipped demo ------------------------------------------------------------

MTP_PROMPT = "import os\n\n\ndef list_files(path):"


@pytest.fixture(scope="module")
def demo_registry():
    from foretell.plugin.loader import load_plugins

    return load_plugins().registry


def test_mtp_after_a_hit_speculates_from_its_restored_head_cache(demo_registry, monkeypatch,
                                                                 tmp_path):
    spy = Spy(monkeypatch, rows_class("mtp"))
    options = dict(max_tokens=40, chat=False, ignore_eos=True)
    reference = foretell.load("demo", registry=demo_registry)
    expected = reference.generate_text(MTP_PROMPT, speculate=False, **options)
    writer = engine_with("demo", demo_registry, ("mtp", None), tmp_path, k=2)
    events = list(writer.generate(MTP_PROMPT, **options))
    assert "".join(e.text for e in events[:-1]) == expected
    ram = list(writer.generate(MTP_PROMPT, **options))
    assert writer.cache.close(10).durable
    spy.reset()
    ssd = list(engine_with("demo", demo_registry, ("mtp", None), tmp_path, k=2)
               .generate(MTP_PROMPT, **options))
    for stream, tier in ((ram, "ram"), (ssd, "ssd")):
        stats = stream[-1]
        assert "".join(e.text for e in stream[:-1]) == expected
        assert stats.cached_from == tier
        # Before attachments a hit made MTP decode plainly (no hidden states over the
        # prompt); restored, it drafts and is accepted.
        assert stats.speculation["drafted"] > 0 and stats.speculation["accepted"] > 0
    assert spy.restored and spy.prefilled == [0]


def test_mtp_prefers_the_exact_boundary_it_can_speculate_from(demo_registry, monkeypatch):
    """A growing conversation: the next prompt goes on from the last prompt but not from
    the last reply. The prompt + reply entry would serve more tokens trimmed, without the
    head's state (MTP would then decode plainly); the prompt snapshot serves its exact
    boundary with it, and MTP speculates."""
    options = dict(max_tokens=24, ignore_eos=True)
    engine = engine_with("demo", demo_registry, ("mtp", None), k=2)
    prompt = engine.encode_prompt(MTP_PROMPT, chat=False)
    first, _ = run(engine, prompt)
    follow_up = [*prompt, *engine.encode_prompt("\n\n\nclass Tree:\n    def", chat=False)]
    assert follow_up[len(prompt)] != first[0]
    spy = Spy(monkeypatch, rows_class("mtp"))
    events = list(engine.generate(follow_up, **options))
    stats = events[-1]
    assert stats.cached_tokens == len(prompt) - 1 and spy.restored == [len(prompt)]
    assert stats.speculation["drafted"] > 0
    expected = foretell.load("demo", registry=demo_registry).generate(
        follow_up, speculate=False, **options)
    assert [t for e in events[:-1] for t in e.tokens] == [
        t for e in list(expected)[:-1] for t in e.tokens]


# -- resuming a speculative generation ---------------------------------------------------


def interrupted_then_resumed(path, registry, draft, cache_dir, sampling, prompt, dies_after,
                             k=3):
    engine = engine_with(path, registry, draft, cache_dir, k=k)
    engine.cache.checkpoint_every = 3
    # The process "dies" after 8 tokens: no completion, no cleanup.
    dies_after(8, lambda: engine.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          sampling=sampling, resume=True))
    assert engine.cache.flush(10).durable
    return run(engine_with(path, registry, draft, cache_dir, k=k), prompt,
               sampling=sampling, resume=True)


@pytest.mark.parametrize("sampling", [None, SamplingConfig(temp=0.8, seed=11)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("target", ["qwen3", "gemma3_text"])
@pytest.mark.parametrize("kind", ["two-model", "ngram"])
def test_a_resumed_speculative_generation_continues_the_same_stream(
        model_dirs, registry, monkeypatch, tmp_path, kind, target, sampling, dies_after):
    draft = drafters(model_dirs, registry, target)[kind]
    path = model_dirs[target]
    uninterrupted, _ = run(engine_with(path, registry, draft), PROMPT_REPEATS, sampling=sampling)
    spy = Spy(monkeypatch, rows_class(kind))
    resumed, stats = interrupted_then_resumed(path, registry, draft, tmp_path, sampling,
                                              PROMPT_REPEATS, dies_after)
    assert stats.cached_from == "checkpoint"
    assert resumed == uninterrupted
    # Seeded too: each position's token is drawn with that position's key, as plain
    # sampling draws it (tests/spec/test_seeded_runs.py).
    assert resumed == plain(path, registry, PROMPT_REPEATS, sampling=sampling)
    # The resumed request speculated on from the drafter's checkpointed state.
    assert len(spy.restored) == 1 and spy.restored[0] > len(PROMPT_REPEATS)
    assert stats.speculation["drafted"] > 0


@pytest.mark.parametrize("sampling", [None, SamplingConfig(temp=0.8, seed=5)],
                         ids=["greedy", "sampled"])
def test_a_resumed_mtp_generation_continues_the_same_stream(demo_registry, tmp_path, sampling,
                                                            dies_after):
    prompt = foretell.load("demo", registry=demo_registry).encode_prompt(MTP_PROMPT, chat=False)
    uninterrupted, _ = run(engine_with("demo", demo_registry, ("mtp", None), k=2), prompt,
                           sampling=sampling)
    resumed, stats = interrupted_then_resumed("demo", demo_registry, ("mtp", None), tmp_path,
                                              sampling, prompt, dies_after, k=2)
    assert stats.cached_from == "checkpoint" and stats.speculation["drafted"] > 0
    assert resumed == uninterrupted


def test_another_drafter_never_resumes_a_speculative_checkpoint(model_dirs, registry, tmp_path,
                                                                dies_after):
    path = model_dirs["qwen3"]
    ours = drafter(registry, "two-model", model=str(model_dirs["qwen3"]))
    engine = engine_with(path, registry, ours, tmp_path)
    engine.cache.checkpoint_every = 3
    dies_after(10, lambda: engine.generate(PROMPT_REPEATS, max_tokens=MAX_TOKENS,
                                           ignore_eos=True, resume=True))
    assert engine.cache.flush(10).durable
    other = drafter(registry, "two-model", model=str(model_dirs["qwen3-other"]))
    _, stats = run(engine_with(path, registry, other, tmp_path), PROMPT_REPEATS, resume=True)
    assert stats.cached_from != "checkpoint"
    _, stats = run(engine_with(path, registry, ours, tmp_path, k=2), PROMPT_REPEATS, resume=True)
    assert stats.cached_from != "checkpoint"  # another draft length draws differently
    _, stats = run(engine_with(path, registry, ours, tmp_path), PROMPT_REPEATS, resume=True)
    assert stats.cached_from == "checkpoint"  # the checkpoint was there all along


def test_a_drafter_that_fails_to_restore_is_prefilled_instead(model_dirs, registry,
                                                             monkeypatch, caplog):
    import logging

    engine = engine_with(model_dirs["qwen3"], registry, drafters(model_dirs, registry)["two-model"])
    run(engine, PROMPT)

    def broken(rows, row, start):
        raise ValueError("stored state from elsewhere")

    rows = rows_class("two-model")
    monkeypatch.setattr(rows, "_restored", broken)
    spy = Spy(monkeypatch, rows)
    with caplog.at_level(logging.WARNING, logger="foretell.spec"):
        tokens, stats = run(engine, PROMPT)
    # Offered the state, it failed; the row joined again with the prompt to prefill.
    assert stats.cached_from == "ram" and spy.restored == [len(PROMPT)]
    assert spy.prefilled == [0, len(PROMPT)]
    assert tokens == plain(model_dirs["qwen3"], registry, PROMPT)
    assert "failed in restore()" in caplog.text and "two-model" in caplog.text


def test_a_sampled_speculative_run_resumes_after_kill_9_on_the_same_draws(
    tmp_path, killed_and_resumed
):
    """``foretell run --resume`` with speculation and sampling: killed with SIGKILL once a
    checkpoint is on disk, the rerun of the same command prints what an uninterrupted run
    prints, and it speculated from the checkpoint (its stats say so)."""
    import json
    import os
    import sys

    config = tmp_path / "run.toml"
    config.write_text('[cache]\ncheckpoint_every = 4\n\n[draft]\nkind = "two-model"\n'
                      'model = "demo-draft"\nnum_tokens = 3\nadaptive = false\n')
    args = [sys.executable, "-m", "foretell", "run", "--max-tokens", "120", "--temp", "0.8",
            "--seed", "7", "--prompt", "def fibonacci(n):", "--config", str(config)]
    env = {**os.environ, "FORETELL_DEBUG": "1"}
    uninterrupted, resumed = killed_and_resumed(args, env, ["--json"])
    stats = json.loads(resumed.stdout.decode().strip().splitlines()[-1])
    text = "".join(e["text"] for e in map(json.loads, resumed.stdout.decode().splitlines())
                   if e.get("type") == "text")
    assert stats["cached_from"] == "checkpoint" and stats["speculation"]["drafted"] > 0
    assert len(text) > 40 and text == uninterrupted.stdout.decode().rstrip("\n")


def test_a_second_process_restores_the_drafter_from_disk(tmp_path):
    """Two ``foretell run`` processes over one cache directory: the second one's drafter
    comes back from the SSD entry (its stats count the tokens), and its text is the first's."""
    import json
    import subprocess
    import sys

    args = [sys.executable, "-m", "foretell", "run", "--max-tokens", "40", "--draft-model",
            "demo-draft", "--num-draft-tokens", "3", "--prompt", "def fibonacci(n):",
            "--cache-dir", str(tmp_path / "cache"), "--json"]

    def once():
        done = subprocess.run(args, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr.decode()
        events = [json.loads(line) for line in done.stdout.decode().splitlines()]
        return "".join(e["text"] for e in events if e["type"] == "text"), events[-1]

    first_text, first = once()
    second_text, second = once()
    assert first["speculation"]["draft_cached_tokens"] == 0
    assert second["cached_from"] == "ssd"
    assert second["speculation"]["draft_cached_tokens"] == second["prompt_tokens"]
    assert second_text == first_text


def test_a_resumed_generation_with_the_adaptive_length_stays_greedy_identical(
        model_dirs, registry, tmp_path, dies_after):
    """With the adaptive length (the default) the rounds differ from run to run; greedy
    output may not, resumed or not."""
    path = model_dirs["qwen3"]
    draft = drafters(model_dirs, registry)["two-model"]
    engine = foretell.load(path, registry=registry)
    engine.cache = CacheTier.for_engine(engine, tmp_path)
    engine.cache.checkpoint_every = 3
    engine.use_draft(*draft, max_tokens=4, adaptive=True)
    dies_after(10, lambda: engine.generate(PROMPT_REPEATS, max_tokens=MAX_TOKENS,
                                           ignore_eos=True, resume=True))
    assert engine.cache.flush(10).durable
    resumed = foretell.load(path, registry=registry)
    resumed.cache = CacheTier.for_engine(resumed, tmp_path)
    resumed.use_draft(*draft, max_tokens=4, adaptive=True)
    tokens, stats = run(resumed, PROMPT_REPEATS, resume=True)
    assert stats.cached_from == "checkpoint"
    assert tokens == plain(path, registry, PROMPT_REPEATS)


@pytest.mark.parametrize("kind", ["two-model", "ngram"])
def test_the_block_store_keeps_the_drafter_state_too(model_dirs, registry, monkeypatch,
                                                     tmp_path, kind):
    """The attachment is an ordinary layer: the segmented block store (``layout =
    "blocks"``) stores and restores it like the single-file layout."""
    from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

    draft = drafters(model_dirs, registry)[kind]

    def engine():
        e = foretell.load(model_dirs["qwen3"], registry=registry)
        e.cache = CacheTier.for_engine(e, tmp_path, layout=BlockStoreLayout,
                                       layout_config=BlockStoreConfig(block_tokens=8))
        e.use_draft(*draft, max_tokens=3, adaptive=False)
        return e

    writer = engine()
    original, _ = run(writer, PROMPT_REPEATS)
    assert writer.cache.close(10).durable
    spy = Spy(monkeypatch, rows_class(kind))
    restored, stats = run(engine(), PROMPT_REPEATS)
    assert stats.cached_from == "ssd" and spy.restored == [len(PROMPT_REPEATS)]
    assert restored == original == plain(model_dirs["qwen3"], registry, PROMPT_REPEATS)


# -- in a batch --------------------------------------------------------------------------------


def _submitted(engine, prompt, **options):
    events = list(engine.submit(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, **options))
    return [t for e in events[:-1] for t in e.tokens], events[-1]


@pytest.mark.parametrize("kind", ["two-model", "ngram"])
def test_in_a_batch_a_hit_restores_the_drafters_row_and_its_end_is_stored(
        model_dirs, registry, kind):
    """Rows go through the same cache link as a single request: the state a batch row's
    drafter had after its prompt is stored with the prompt's entry, a later row hitting it
    restores the drafter instead of prefilling it, and a row's state at its end is stored
    with its final entry (a continuation finds it)."""
    engine = engine_with(model_dirs["qwen3"], registry, drafters(model_dirs, registry)[kind])
    first, cold = _submitted(engine, PROMPT_REPEATS)
    again, warm = _submitted(engine, PROMPT_REPEATS)
    assert warm.cached_from == "ram" and warm.cached_tokens == len(PROMPT_REPEATS) - 1
    assert (cold.speculation["draft_cached_tokens"],
            warm.speculation["draft_cached_tokens"]) == (0, len(PROMPT_REPEATS))
    assert again == first == plain(model_dirs["qwen3"], registry, PROMPT_REPEATS)
    follow = PROMPT_REPEATS + first
    more, continued = _submitted(engine, follow)
    # The state the row ended with (all but the tokens of its last round, which it had not
    # been fed yet), not the prompt's.
    assert len(PROMPT_REPEATS) < continued.speculation["draft_cached_tokens"] < len(follow)
    assert more == plain(model_dirs["qwen3"], registry, follow)


def test_in_a_batch_mtp_after_a_hit_speculates_from_its_restored_head(demo_registry):
    options = dict(chat=False, ignore_eos=True)
    reference = foretell.load("demo", registry=demo_registry)
    expected = reference.generate_text(MTP_PROMPT, speculate=False, max_tokens=MAX_TOKENS,
                                       **options)
    engine = engine_with("demo", demo_registry, ("mtp", None), k=2)
    for _ in range(2):  # a miss, then a RAM hit
        events = list(engine.submit(MTP_PROMPT, max_tokens=MAX_TOKENS, **options))
        stats = events[-1]
        assert "".join(e.text for e in events[:-1]) == expected
        assert stats.speculation["drafted"] > 0 and stats.speculation["accepted"] > 0
    assert stats.cached_from == "ram" and stats.speculation["draft_cached_tokens"] > 0
