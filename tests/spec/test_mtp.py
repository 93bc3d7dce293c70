"""Qwen-MTP on the shipped demo target (which carries an mtp.* head): greedy output equals
plain greedy decoding, chained or not, and the head actually predicts (it is accepted
often, so the test exercises accepted bursts, not only rejections)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def demo():
    import foretell

    return foretell.load("demo")


PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def"]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafting_reproduces_plain_greedy(demo, k):
    speculator = demo.use_draft("mtp", max_tokens=k, adaptive=False)
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = demo.generate_text(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                   speculate=False)
        events = list(demo.generate(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                    speculate=speculator))
        assert "".join(e.text for e in events[:-1]) == plain
        accepted += events[-1].speculation["accepted"]
        drafted += events[-1].speculation["drafted"]
    assert accepted / drafted > 0.5


def test_mtp_needs_the_hidden_and_mtp_ports(demo):
    from foretell.spec import PORT_HIDDEN, PORT_MTP

    speculator = demo.use_draft("mtp")
    assert speculator.provider.requires == {PORT_HIDDEN, PORT_MTP}
    assert speculator.max_tokens == 6  # the head's own preferred length (docs/benchmarks.md)
    assert PORT_MTP in demo.model.capabilities


def test_mtp_over_fixed_shapes_reproduces_plain_greedy(demo, monkeypatch):
    """The CUDA default (foretell.model.fixed), forced on: nothing emitted changes."""
    from foretell.model import fixed

    monkeypatch.setattr(fixed, "_MODE", "on")
    used = []
    real = fixed.FixedForward.__call__

    def counted(self, *arrays, caches, length):
        qualifies = fixed.fits_fixed_shapes(caches)  # others take the ordinary forward
        out = real(self, *arrays, caches=caches, length=length)
        if qualifies:
            used.append((self.name, out is not None))
        return out

    monkeypatch.setattr(fixed.FixedForward, "__call__", counted)
    speculator = demo.use_draft("mtp", max_tokens=3, adaptive=False)
    for prompt in PROMPTS:
        plain = demo.generate_text(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                   speculate=False)
        text = demo.generate_text(prompt, max_tokens=40, chat=False, ignore_eos=True,
                                  speculate=speculator)
        assert text == plain
    assert all(ran for _name, ran in used)


def test_mtp_replays_its_forwards_over_fixed_shapes(demo, monkeypatch):
    from foretell.model import fixed

    monkeypatch.setattr(fixed, "_MODE", "on")
    used = []
    real = fixed.FixedForward.__call__

    def counted(self, *arrays, caches, length):
        out = real(self, *arrays, caches=caches, length=length)
        used.append((self.name, out is not None))
        return out

    monkeypatch.setattr(fixed.FixedForward, "__call__", counted)
    speculator = demo.use_draft("mtp", max_tokens=3, adaptive=False)
    demo.generate_text(PROMPTS[0], max_tokens=40, chat=False, ignore_eos=True,
                       speculate=speculator)
    assert {name for name, ran in used if ran} == {"verify forward", "MTP head"}


def test_a_row_joining_mtp_rows_after_a_lone_rows_fixed_forwards_decodes_as_alone(
    demo, monkeypatch, held_mid_request
):
    """A lone row's head cache grew to a whole capacity step over fixed shapes; a second
    request's row joins it (the head's rows share one batch cache) and both stay plain
    greedy's."""

    from foretell.model import fixed
    from foretell.scheduler import Scheduler

    monkeypatch.setattr(fixed, "_MODE", "on")
    used = []
    real_call = fixed.FixedForward.__call__

    def counted(self, *arrays, caches, length):
        out = real_call(self, *arrays, caches=caches, length=length)
        used.append((self.name, out is not None))
        return out

    speculator = demo.use_draft("mtp", max_tokens=3, adaptive=False)
    prompts = [demo.tokenizer.encode(p) for p in PROMPTS[:2]]
    plain = [demo.generate_text(p, max_tokens=40, chat=False, ignore_eos=True,
                                speculate=False) for p in PROMPTS[:2]]
    monkeypatch.setattr(fixed.FixedForward, "__call__", counted)
    paused, go, rows = held_mid_request()
    scheduler = Scheduler(demo)
    first = scheduler.submit(prompts[0], max_tokens=40, ignore_eos=True, speculate=speculator)
    assert paused.wait(60)
    assert ("MTP head", True) in used
    second = scheduler.submit(prompts[1], max_tokens=40, ignore_eos=True,
                              speculate=speculator)
    go.set()
    texts = ["".join(e.text for e in list(handle)[:-1]) for handle in (first, second)]
    scheduler.close()
    assert texts == plain
    assert 2 in rows


def test_a_plain_stretch_keeps_each_steps_hidden_once_and_hands_the_head_the_newest(
        demo, monkeypatch):
    """While drafting is off a plain step keeps the batch's hidden states once (the last
    CATCH_UP_MAX + 1 steps' arrays), nothing per row: holding each row's state every step cost
    decode speed. When drafting resumes the head hears exactly the states that predicted its
    newest CATCH_UP_MAX tokens, in order, and the output stays plain greedy's."""
    import mlx.core as mx

    from foretell.spec import CATCH_UP_MAX
    from foretell.spec.policy import PLAIN_STRETCH
    from foretell.spec.step_hidden import StepHidden
    from foretell.spec.warmup import ScriptedPolicy
    from foretell_qwen.mtp_rows import MTPRows

    speculator = demo.use_draft("mtp", max_tokens=3, adaptive=False)
    stretches = 7  # plain stretches, then drafting again
    object.__setattr__(speculator, "policy",
                       ScriptedPolicy(3, [3, 3] + [0] * stretches + [3, 3]))
    # Per step since the last draft: the positions that predicted the row's kept tokens.
    since, feeds, held, prompt_hidden = [], [], [0], []
    real_record, real_draft = StepHidden.record, MTPRows.draft

    def record(self, hidden, rows, kept=None):
        since.append(hidden[:1, : kept[0]] if kept is not None else hidden[:1])
        prompt_hidden.append(len(rows[0].feed_hidden))
        real_record(self, hidden, rows, kept)
        held[0] = max(held[0], len(self._steps))

    def draft(rows, row_feeds, lengths):
        feeds.extend((feed, list(since)) for feed, k in zip(row_feeds, lengths) if k)
        since.clear()
        return real_draft(rows, row_feeds, lengths)

    monkeypatch.setattr(StepHidden, "record", record)
    monkeypatch.setattr(MTPRows, "draft", draft)
    prompt = PROMPTS[0]
    n = 90
    text = demo.generate_text(prompt, max_tokens=n, chat=False, ignore_eos=True,
                              speculate=speculator)
    monkeypatch.undo()
    assert text == demo.generate_text(prompt, max_tokens=n, chat=False, ignore_eos=True,
                                      speculate=False)
    feed, steps = max(feeds, key=lambda pair: len(pair[1]))
    assert len(steps) >= 6 * PLAIN_STRETCH
    assert feed.hidden.shape[1] == CATCH_UP_MAX < len(feed.tokens)
    newest = mx.concatenate(steps, axis=1)[:, -CATCH_UP_MAX:]
    assert mx.array_equal(feed.hidden, newest).item()
    assert held[0] == CATCH_UP_MAX + 1 and set(prompt_hidden) == {0}


def test_a_head_far_behind_starts_over_from_the_last_positions(demo):
    """After a long plain stretch the head does not absorb every skipped position: it starts
    a fresh cache over the last CATCH_UP_MAX of them, in one forward of that fixed length,
    and drafts what a head that had heard only those positions drafts. A few positions
    behind, it absorbs all of them into the cache it has."""
    import mlx.core as mx

    from foretell.sampling import Sampler
    from foretell.spec import CATCH_UP_MAX, Feed

    model = demo.model
    tokens = [(7 * i) % 90 + 5 for i in range(CATCH_UP_MAX + 40)]
    hidden, _ = model.forward(mx.array([tokens], dtype=mx.int32), model.make_caches())
    provider = demo.use_draft("mtp").provider
    target = demo.target

    def source_after(prompt_len: int):
        source = provider.open(target, Sampler())
        source.prefill(Feed(tokens[:prompt_len], hidden[:, : prompt_len - 1]))
        return source

    behind = source_after(8)
    lengths = []
    forward = behind._forward
    behind._forward = lambda e, h: (lengths.append(e.shape[1]), forward(e, h))[1]
    stretch = Feed(tokens[8:], hidden[:, 7:-1])  # every position since the prompt's
    drafted = behind.draft(stretch, 3).tokens.tolist()
    assert lengths == [CATCH_UP_MAX, 1, 1]
    assert behind.caches[0].offset == CATCH_UP_MAX + 2  # the two chained positions
    # The verifier hands it only the newest states of a long stretch: the same drafts.
    newest = source_after(8)
    assert newest.draft(Feed(tokens[8:], hidden[:, -CATCH_UP_MAX - 1 : -1]), 3).tokens.tolist() \
        == drafted
    assert newest.caches[0].offset == CATCH_UP_MAX + 2

    fresh = provider.open(target, Sampler())
    fresh.prefill(Feed(tokens[-CATCH_UP_MAX - 1:], hidden[:, -CATCH_UP_MAX - 1:-1]))
    assert drafted == fresh.draft(Feed([]), 3).tokens.tolist()

    near = source_after(len(tokens) - CATCH_UP_MAX)
    held = near.caches[0].offset
    near.draft(Feed(tokens[-CATCH_UP_MAX:], hidden[:, -CATCH_UP_MAX - 1:-1]), 1)
    assert near.caches[0].offset == held + CATCH_UP_MAX
