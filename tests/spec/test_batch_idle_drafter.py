"""Rows carrying a drafter that does not draft cost a plain batch step what plain rows cost:
a step keeps the batch's hidden states once (:class:`~foretell.spec.step_hidden.StepHidden`) and a
row's drafter reads its own only when it is fed; rows whose drafter reads hidden states share
the prefill forward; a drafter's rows joining together join in one append (the two-model
drafter prefills them in one forward). Output stays what each request streams alone."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import mlx.core as mx
import pytest
from spec_helpers import RecordingRows

import foretell
from foretell.sampling import Sampler
from foretell.scheduler import Scheduler
from foretell.spec import CATCH_UP_MAX, Feed, RowStart
from foretell.spec.batch import DraftGroup
from foretell.spec.step_hidden import StepHidden

H = 4


def _row(name):
    return SimpleNamespace(name=name)


def _step(rows, width=1, base=0.0):
    """A step's hidden ``[B, width, H]``: row b's position i holds ``base + 10 b + i``."""
    values = [[[base + 10 * b + i] * H for i in range(width)] for b in range(len(rows))]
    return mx.array(values)


def _firsts(hidden):
    return hidden[0, :, 0].tolist()


# -- StepHidden ---------------------------------------------------------------------------

def test_a_rows_states_come_from_each_step_it_was_in_in_order():
    """Plain steps, a verify step (each row keeping its own count) and a row joining in
    between (the batch's own list extended in place): each row reads the positions that
    predicted its kept tokens, since the step it was last fed."""
    steps = StepHidden()
    a, b, c = _row("a"), _row("b"), _row("c")
    rows = [a, b]
    steps.record(_step(rows, base=100), rows)            # serial 0
    steps.record(_step(rows, width=3, base=200), rows, [2, 3])  # 1: a kept 2, b kept 3
    rows.append(c)                                        # c joins: heard up to serial 2
    steps.record(_step(rows, base=300), rows)            # 2
    steps.record(_step(rows, base=400), rows)            # 3
    got = steps.newest([(a, 0, 5, False), (b, 1, 5, False), (c, 2, 2, False), (a, 0, 0, False)])
    assert _firsts(got[0]) == [100, 200, 201, 300, 400]
    assert _firsts(got[1]) == [210, 211, 212, 310, 410]
    assert _firsts(got[2]) == [320, 420]
    assert got[3] is None


def test_a_rows_unread_token_state_is_left_out_and_only_the_newest_kept():
    steps = StepHidden()
    a, b = _row("a"), _row("b")
    rows = [a, b]
    for i in range(3 * CATCH_UP_MAX):
        steps.record(_step(rows, base=1000 * i), rows)
    newest, = steps.newest([(b, 0, 3 * CATCH_UP_MAX - 1, True)])
    # The last step's state predicted b's unread token: its feed's newest is the step before.
    expected = [1000 * i + 10 for i in range(2 * CATCH_UP_MAX - 1, 3 * CATCH_UP_MAX - 1)]
    assert _firsts(newest) == expected
    assert len(steps._steps) == CATCH_UP_MAX + 1  # what a feed can need, no more


# -- DraftGroup joins ------------------------------------------------------------------------

class _Rows(RecordingRows):
    """Rows that record each append; an append holding a poisoned start raises (none join)."""

    def __init__(self) -> None:
        super().__init__()
        self.appends: list[list[list[int]]] = []

    def append(self, starts):
        if any(99 in s.feed.tokens for s in starts):
            raise ValueError("poisoned")
        self.appends.append([list(s.feed.tokens) for s in starts])
        super().append(starts)


def _group():
    rows = _Rows()
    provider = SimpleNamespace(requires=frozenset(), open_rows=lambda target: rows)
    speculator = SimpleNamespace(provider=provider, wants_hidden=False, label=lambda: "rec")
    return DraftGroup(speculator, SimpleNamespace(model=SimpleNamespace(vocab_size=100))), rows


def _member(prompt):
    return SimpleNamespace(state=SimpleNamespace(prompt=list(prompt), generated=[], cached=0),
                           sampler=Sampler(), feed_hidden=[])


def test_rows_are_fed_their_sequences_when_first_asked_to_draft_together_in_one_append():
    """Joining costs a drafter nothing: rows wait dormant, and those asked to draft are fed
    everything so far in one append (the two-model drafter: one forward); a row never asked
    is never fed, and its step costs it nothing."""
    group, rows = _group()
    members = [_member([1, 2]), _member([3]), _member([4, 5, 6])]
    assert group.add(members) == [True, True, True]
    assert rows.appends == [] and group.members == [] and group.serves == members
    for member, tokens in zip(members, ([7], [8, 9], [10])):
        member.state.generated += tokens
    assert group.draft(members, [0, 0, 0]) == {} and rows.appends == []
    drafted = group.draft(members, [2, 0, 1])
    assert rows.appends == [[[1, 2, 7], [4, 5, 6, 10]]] and group.woken == 2
    assert group.members == [members[0], members[2]] and group.dormant == [members[1]]
    assert sorted(drafted) == [0, 2]
    members[0].state.generated += [11]
    group.draft(members, [1, 0, 0])
    assert not group.woken and rows.heard[0] == [1, 2, 7, 11]


def test_a_row_whose_drafter_refuses_it_leaves_the_others_fed():
    """An append that raises joins none: the rows are appended one by one, so only the row
    its drafter refused leaves (``refused``: it decodes plainly), and the others join in
    order and draft this very step."""
    group, rows = _group()
    members = [_member([1, 2]), _member([99]), _member([4])]
    assert group.add(members) == [True, True, True]
    members[0].state.generated += [7, 8]
    members[2].state.generated += [9]
    drafted = group.draft(members, [1, 1, 1])
    assert [row for row, _ in group.refused] == [members[1]]
    assert isinstance(group.refused[0][1], ValueError)
    assert group.members == [members[0], members[2]] and group.serves == group.members
    assert rows.heard == [[1, 2, 7, 8], [4, 9]] and sorted(drafted) == [0, 2]


# -- the scheduler ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    return foretell.load("demo")


TEXTS = ["def fibonacci(n):", "import os\n\n\ndef list_files(path):", "class Stack:\n    def",
         "for i in range(10):\n    print("]


def _alone(engine, prompt, n):
    return engine.generate_text(prompt, max_tokens=n, chat=False, ignore_eos=True,
                                speculate=False)


def _text(handle):
    events = list(handle)
    return "".join(e.text for e in events[:-1]), events[-1]


def _arriving_together(engine, monkeypatch, speculator, prompts, lengths):
    """Submit ``prompts`` while the worker is held in the first one's prefill, so the rest
    are admitted at one step; their handles and the target's forward shapes."""
    scheduler = Scheduler(engine)
    scheduler._token_bytes_now()  # (its one-token forward measures the KV, once)
    forward, shapes = engine.model.forward, []
    held, go = threading.Event(), threading.Event()

    def watched(tokens, caches, *args, **kwargs):
        shapes.append(tuple(tokens.shape))
        if not held.is_set():
            held.set()
            go.wait(timeout=60)
        return forward(tokens, caches, *args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", watched)
    first = scheduler.submit(prompts[0], max_tokens=lengths[0], ignore_eos=True,
                             speculate=speculator)
    assert held.wait(timeout=60)
    rest = [scheduler.submit(p, max_tokens=n, ignore_eos=True, speculate=speculator)
            for p, n in zip(prompts[1:], lengths[1:])]
    go.set()
    return scheduler, [first, *rest], shapes


def test_mtp_rows_arriving_together_share_one_prefill_forward(demo, monkeypatch):
    """Rows whose drafter reads hidden states prefill in one forward (each prompt's states
    without the padding reach the head) and stream what each streams alone."""
    from foretell_qwen.mtp_rows import MTPRows

    speculator = demo.use_draft("mtp", max_tokens=3, adaptive=False)
    prompts = [demo.encode_prompt(t, chat=False) for t in TEXTS]
    lengths = [12, 20, 16, 18]
    starts = []
    append = MTPRows.append
    monkeypatch.setattr(MTPRows, "append", lambda rows, s: (starts.append(list(s)),
                                                              append(rows, s))[1])
    scheduler, handles, shapes = _arriving_together(demo, monkeypatch, speculator, prompts,
                                                    lengths)
    results = [_text(h) for h in handles]
    scheduler.close()
    monkeypatch.undo()
    together = [len(p) - 1 for p in prompts[1:]]
    assert (len(together), max(together)) in shapes  # one forward for the three prompts
    assert [len(s) for s in starts] == [1, 3]  # and they joined the head's rows together
    for start, prompt in zip(starts[1], prompts[1:]):
        hidden, _ = demo.model.forward(mx.array([prompt[:-1]]), demo.model.make_caches())
        assert start.feed.hidden.shape == hidden.shape
        assert mx.allclose(start.feed.hidden, hidden, atol=1e-3, rtol=1e-3).item()
    drafted = accepted = 0
    for text, prompt, n, (got, stats) in zip(TEXTS, prompts, lengths, results):
        assert got == _alone(demo, prompt, n), text
        drafted += stats.speculation["drafted"]
        accepted += stats.speculation["accepted"]
    assert accepted / drafted > 0.5


def test_mtp_rows_idle_past_the_catch_up_then_drafting_hear_their_newest_states(
        demo, monkeypatch):
    """A batch whose policy drafts nothing for longer than CATCH_UP_MAX steps, then drafts:
    each row's head hears the states the batch's steps computed for its newest CATCH_UP_MAX
    tokens, the head's drafts are kept as often as usual, and every row streams plain
    greedy's text."""
    from foretell_qwen.mtp_rows import MTPRows

    speculator = demo.use_draft("mtp", max_tokens=3)  # adaptive: the batch policy decides
    idle = CATCH_UP_MAX + 8
    scheduler = Scheduler(demo)
    chosen = []

    def choose(caps, rates, top=None, draining=None, dormant=0):
        caps = caps() if callable(caps) else caps
        chosen.append(len(chosen) >= idle)
        return [min(3, cap) if chosen[-1] else 0 for cap in caps]

    monkeypatch.setattr(scheduler._policy, "choose", choose)
    recorded, feeds = [], []
    record, draft = StepHidden.record, MTPRows.draft
    monkeypatch.setattr(StepHidden, "record", lambda self, hidden, rows, kept=None: (
        recorded.append((hidden, list(rows), kept)), record(self, hidden, rows, kept))[1])
    monkeypatch.setattr(MTPRows, "draft", lambda rows, f, lengths: (
        feeds.append((list(f), len(recorded))), draft(rows, f, lengths))[1])
    prompts = [demo.encode_prompt(t, chat=False) for t in TEXTS[:2]]
    n = idle + 30
    handles = [scheduler.submit(p, max_tokens=n, ignore_eos=True, speculate=speculator)
               for p in prompts]
    results = [_text(h) for h in handles]
    scheduler.close()
    monkeypatch.undo()
    for prompt, (got, _stats) in zip(prompts, results):
        assert got == _alone(demo, prompt, n)
    first, steps = feeds[0]  # the first draft, after this many steps
    batch = recorded[steps - 1][1]  # the head's rows are the batch's, in its order
    for row, feed in zip(batch, first):
        assert len(feed.tokens) > CATCH_UP_MAX and feed.hidden.shape[1] == CATCH_UP_MAX
        mine = [h[r.index(row) : r.index(row) + 1] for h, r, _ in recorded[:steps] if row in r]
        newest = mx.concatenate(mine, axis=1)[:, -CATCH_UP_MAX:]
        assert mx.array_equal(feed.hidden, newest).item()
    drafted = sum(s.speculation["drafted"] for _, s in results)
    assert sum(s.speculation["accepted"] for _, s in results) / drafted > 0.5


def test_a_row_finishing_in_a_plain_step_stores_its_drafters_unheard_feed(demo, monkeypatch):
    """A speculating row that ends in a pipelined plain step hands the cache tier the states
    of the tokens its head has not heard, not the state of the token drawn after its last."""
    from foretell.cache.tier import CacheTier
    from foretell.spec.attach import DraftLink
    from foretell.spec.warmup import ScriptedPolicy

    engine = foretell.load("demo")
    engine.cache = CacheTier.for_engine(engine)
    speculator = engine.use_draft("mtp", max_tokens=3, adaptive=False)
    object.__setattr__(speculator, "policy", ScriptedPolicy(3, [3] + [0] * 100))
    captured, recorded = [], []
    capture, record = DraftLink.capture, StepHidden.record

    def spying(self, source, state, feed_tokens, hidden):
        captured.append((list(feed_tokens), hidden))
        return capture(self, source, state, feed_tokens, hidden)

    monkeypatch.setattr(DraftLink, "capture", spying)
    monkeypatch.setattr(StepHidden, "record", lambda self, hidden, rows, kept=None: (
        recorded.append((hidden[:1], kept)), record(self, hidden, rows, kept))[1])
    prompt = engine.encode_prompt(TEXTS[0], chat=False)
    n = 20
    text = engine.generate_text(prompt, max_tokens=n, chat=False, ignore_eos=True)
    monkeypatch.undo()
    assert text == _alone(demo, prompt, n)
    tokens, hidden = captured[-1]  # at the end: the head heard none since its one draft
    (verified, kept), *plain = recorded
    assert kept is not None and all(k is None for _, k in plain)
    states = [verified[:, : kept[0]], *(h for h, _ in plain)]
    # The last plain step's state predicted a token never kept: it is left out.
    assert len(tokens) == n == sum(h.shape[1] for h in states) - 1 < CATCH_UP_MAX
    assert mx.array_equal(hidden, mx.concatenate(states, axis=1)[:, :-1]).item()


def test_two_model_rows_joining_together_prefill_in_one_forward(engines, model_dirs,
                                                                 registry):
    """The draft model prefills rows appended together in one forward and they draft what
    rows appended one by one draft (a Gemma draft whose window the prompts wrap too)."""
    from foretell.plugin import Kind
    from foretell.spec import make_speculator

    for name in ("qwen3", "gemma3_text"):
        engine = engines[name]
        config = registry.get(Kind.DRAFT, "two-model").config
        speculator = make_speculator(registry, engine.target, "two-model",
                                     config(model=str(model_dirs[name])), max_tokens=3)
        prompts = [[(7 * i + j) % 400 + 3 for i in range(length)]
                   for j, length in enumerate((20, 5, 13))]

        starts = [RowStart(feed=Feed(p), sampler=Sampler()) for p in prompts]
        together = speculator.provider.open_rows(engine.target)
        one_by_one = speculator.provider.open_rows(engine.target)
        widths = _counting_forwards(together.model)
        try:
            together.append(starts)
            assert widths == [(3, max(len(p) for p in prompts) - 1)], name
            for start in starts:
                one_by_one.append([start])
        finally:
            del together.model.forward
        feeds = [Feed([5, 9]), Feed([11]), Feed([2, 3, 4])]
        drafts = [rows.draft(feeds, [3, 3, 3]).tokens.tolist()
                  for rows in (together, one_by_one)]
        assert drafts[0] == drafts[1], name


def _counting_forwards(model):
    """The shapes of ``model``'s forwards from now on (``del model.forward`` ends it)."""
    forward, shapes = model.forward, []
    model.forward = lambda tokens, caches: (shapes.append(tokens.shape),
                                            forward(tokens, caches))[1]
    return shapes


# -- the batch policy's choice, step after step ------------------------------------------------

def test_a_settled_choice_of_plain_decoding_is_the_one_the_full_comparison_makes():
    """Where plain decoding wins even at the best row's acceptance for every row, the policy
    decides so without its per-row sums; its choices over a random run are the same as with
    the sums every step."""
    import copy
    import random

    from foretell.spec.batch_policy import BatchDraftPolicy

    rng = random.Random(5)
    fast = BatchDraftPolicy()
    full = copy.deepcopy(fast)
    full._plain_unbeaten = lambda *args: False
    shortcut = []
    plain_unbeaten = fast._plain_unbeaten
    fast._plain_unbeaten = lambda *args: shortcut.append(plain_unbeaten(*args)) or shortcut[-1]
    rows = [object() for _ in range(8)]
    for step in range(600):
        b = rng.choice([2, 4, 8])
        caps = [rng.choice([0, 3, 3, 3, 1]) for _ in range(b)]
        rates = [None if i == 0 else fast.row_rate(rows[i], "k") for i in range(b)]
        chosen = fast.choose(caps, rates, 3)
        assert chosen == full.choose(caps, rates, 3), step
        width = max(chosen, default=0)
        # A draft costs 0.1-0.6 plain steps; rows keep most drafts, then none.
        seconds = 0.01 * (1 + width * rng.uniform(0.1, 0.6)) * rng.uniform(1, 1.3)
        kept = [n - rng.randint(0, 1) if step < 300 else 0 for n in chosen]
        for policy in (fast, full):
            policy.observe(b, width, seconds if step % 7 else None)
            for i, (n, k) in enumerate(zip(chosen, kept)):
                if n:
                    policy.learn("k", n, max(k, 0), rows[i])
    assert any(shortcut) and not all(shortcut)


def test_a_shapes_cost_follows_its_newest_timings():
    from foretell.spec.batch_policy import KEEP, BatchDraftPolicy

    policy = BatchDraftPolicy()
    for _ in range(KEEP):
        policy.observe(4, 0, 0.02)
    assert policy.cost(4, 0) == 0.02
    for _ in range(KEEP // 2):
        policy.observe(4, 0, 0.01)
    assert policy.cost(4, 0) == 0.01  # the lower quartile of the last KEEP


def test_rows_acceptance_estimates_are_read_again_only_when_something_changed():
    from foretell.batch_step import BatchStep
    from foretell.spec.batch_policy import BatchDraftPolicy

    step = BatchStep.__new__(BatchStep)
    step._policy = BatchDraftPolicy()
    reads = []
    row_rate = step._policy.row_rate
    step._policy.row_rate = lambda row, kind: reads.append(row) or row_rate(row, kind)
    speculator = SimpleNamespace(kind="k", adaptive=True, max_tokens=3)

    class Row:  # hashable, compared by identity, as the scheduler's rows
        def __init__(self):
            self.speculator = speculator

    rows = [Row() for _ in range(3)]
    for _ in range(5):
        rates, adaptive, top = step._row_rates(rows)
    assert len(reads) == 3 and adaptive and top == 3
    step._policy.learn("k", 3, 3, rows[1])
    assert step._row_rates(rows)[0][1] > rates[1] and len(reads) == 6
    step._row_rates(rows[:2])  # a row left
    assert len(reads) == 8


def test_mtp_rows_joining_together_absorb_their_prompts_in_one_head_forward(demo):
    """The head absorbs the prompts of rows appended together in one forward, and they
    draft what rows appended one by one draft."""
    provider = demo.use_draft("mtp", max_tokens=3, adaptive=False).provider
    starts = []
    for text in TEXTS[:3]:
        prompt = demo.encode_prompt(text, chat=False)
        hidden, _ = demo.model.forward(mx.array([prompt[:-1]]), demo.model.make_caches())
        starts.append(RowStart(feed=Feed(prompt, hidden), sampler=Sampler()))
    together = provider.open_rows(demo.target)
    one_by_one = provider.open_rows(demo.target)
    head, shapes = together.head, []
    together.head = lambda embedded, hidden, cache: (shapes.append(embedded.shape[:2]),
                                                     head(embedded, hidden, cache))[1]
    together.append(starts)
    together.head = head
    assert shapes == [(3, max(len(s.feed.tokens) for s in starts) - 1)]
    for start in starts:
        one_by_one.append([start])
    assert mx.allclose(together.last, one_by_one.last, atol=1e-4).item()
    assert together.cache.lengths == one_by_one.cache.lengths
    feeds = [Feed([], position=len(s.feed.tokens)) for s in starts]
    assert together.draft(feeds, [3, 3, 3]).tokens.tolist() == \
        one_by_one.draft(feeds, [3, 3, 3]).tokens.tolist()
