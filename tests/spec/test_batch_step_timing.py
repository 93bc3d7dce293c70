"""What the batch step tells the draft policy of each step's time: a pipelined plain step's
time is its wait for the step before it, so it is a plain step's cost only after a
pipelined step over the same rows; the first one after a synchronous (drafted) step, or of
a new batch, waited for nothing and is reported untimed."""

from __future__ import annotations

from foretell.spec.batch_policy import PRIOR_RATE, BatchDraftPolicy


class ScriptedWidths(BatchDraftPolicy):
    """Drafts ``script[i]`` at its ``i``-th choice (0 past its end) and records what the
    step tells it."""

    def __init__(self, script: list[int]) -> None:
        super().__init__()
        self.script, self.told = list(script), []

    def choose(self, caps, rates, top=None, draining=None, dormant=0):
        width = self.script.pop(0) if self.script else 0
        return [min(width, cap) for cap in (caps() if callable(caps) else caps)]

    def observe(self, rows, width, seconds):
        self.told.append((rows, width, seconds))


def test_a_plain_step_is_timed_only_after_a_plain_step_over_the_same_rows(
        engines, model_dirs, registry):
    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=2)
    scheduler = Scheduler(engine)
    policy = scheduler._policy = ScriptedWidths([0, 0, 0, 2, 2, 0, 0, 0])
    prompts = [[11, 57, 300, 4, 89], [120, 7, 250, 3, 9]]
    handles = [scheduler.submit(p, max_tokens=20, ignore_eos=True, speculate=speculator)
               for p in prompts]
    for handle in handles:
        list(handle)
    scheduler.close()
    told = [(w, s is not None) for rows, w, s in policy.told if rows == 2]
    assert told[:8] == [
        (0, False),  # the batch's first step waited for nothing; it reads its rows' first
        (0, False),  # tokens at once, so the next one waited for nothing either
        (0, True),
        (2, False),  # the first drafted step fed the rows' drafters their sequences
        (2, True),  # drafted steps time themselves (the policy judges switching)
        (0, False),  # the first pipelined step after them waited for nothing
        (0, True), (0, True)]


def _finds_nothing(self, rows, lengths):
    """A drafter's search that costs its time (milliseconds, as a lookup over a long
    sequence does: on a toy model a plain step costs little more than a synchronous one)
    and finds no draft."""
    import time

    time.sleep(0.02)
    return {}


def test_a_lone_rows_drafter_that_finds_nothing_is_told_and_stops_being_asked(
        engines, model_dirs, registry, monkeypatch):
    """A drafter that returns no draft (prompt lookup without a match) ran a round that kept
    nothing: its length policy hears of it, switches drafting off and the row decodes in
    pipelined plain steps. Untold, the policy asked it again every step, each step
    synchronous (0.87x plain, measured)."""
    from foretell.batch_step import BatchStep
    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=3)
    plain_steps, told = [], []
    monkeypatch.setattr(BatchStep, "_draft", _finds_nothing)
    plain_step = BatchStep._plain_step
    monkeypatch.setattr(BatchStep, "_plain_step",
                        lambda self: plain_steps.append(1) or plain_step(self))
    observe = type(speculator.policy).observe

    def observing(policy, drafted, accepted, seconds, **options):
        told.append((drafted, accepted))
        return observe(policy, drafted, accepted, seconds, **options)

    monkeypatch.setattr(type(speculator.policy), "observe", observing)
    scheduler = Scheduler(engine)
    list(scheduler.submit([11, 57, 300, 4, 89], max_tokens=60, ignore_eos=True,
                          speculate=speculator))
    scheduler.close()
    drafted = [t for t in told if t[0]]
    assert drafted and all(accepted == 0 for _, accepted in drafted)
    assert len(plain_steps) >= 30, told  # most of the 60 tokens came from pipelined plain steps


def test_batch_rows_whose_drafter_finds_nothing_teach_the_batch_policy(
        engines, model_dirs, registry, monkeypatch):
    """In a batch too: rows whose drafter returned nothing kept none of what they were asked
    to draft, so the batch policy's estimate of their acceptance falls, the steps it asked
    for are timed at the width asked, and the batch goes back to pipelined plain steps
    instead of a synchronous step each time."""
    from foretell.batch_step import BatchStep
    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=3)
    plain_steps = []
    monkeypatch.setattr(BatchStep, "_draft", _finds_nothing)
    plain_step = BatchStep._plain_step
    monkeypatch.setattr(BatchStep, "_plain_step",
                        lambda self: plain_steps.append(1) or plain_step(self))
    scheduler = Scheduler(engine)
    handles = [scheduler.submit(p, max_tokens=60, ignore_eos=True, speculate=speculator)
               for p in ([11, 57, 300, 4, 89], [120, 7, 250, 3, 9])]
    for handle in handles:
        list(handle)
    scheduler.close()
    assert len(plain_steps) >= 30
    # What the rows were asked to draft and did not is in the drafter's record: a drafter
    # whose searches cost nothing is not asked every step on the prior's hopes.
    assert scheduler._policy.prior(speculator.kind) < PRIOR_RATE


def test_a_lone_rows_first_draft_tells_its_policy_the_drafter_was_fed(
        engines, model_dirs, registry, monkeypatch):
    """A lone row's drafter hears its sequence at the row's first draft: that round is told
    ``fed`` (untimed, but counted against the exploring budget), not a one-off the budget
    leaves out; later rounds are told neither."""
    from foretell.plugin import Kind
    from foretell.scheduler import Scheduler
    from foretell.spec import make_speculator

    engine = engines["qwen3"]
    config = registry.get(Kind.DRAFT, "two-model").config
    speculator = make_speculator(registry, engine.target, "two-model",
                                 config(model=str(model_dirs["qwen3"])), max_tokens=2)
    told: list[list[tuple[bool, bool]]] = []
    observe = type(speculator.policy).observe

    def observing(policy, drafted, accepted, seconds, **options):
        if drafted:
            told[-1].append((options.get("fed", False), options.get("one_off", False)))
        return observe(policy, drafted, accepted, seconds, **options)

    monkeypatch.setattr(type(speculator.policy), "observe", observing)
    scheduler = Scheduler(engine)
    for prompt in ([11, 57, 300, 4, 89], [120, 7, 250, 3, 9], [5, 6, 7, 5, 6, 7]):
        told.append([])
        list(scheduler.submit(prompt, max_tokens=20, ignore_eos=True, speculate=speculator))
    scheduler.close()
    drafted = [rounds for rounds in told if rounds]
    assert drafted, told
    for rounds in drafted:  # each request's first drafted round fed its drafter
        assert rounds[0] == (True, False) and all(r == (False, False) for r in rounds[1:]), told
