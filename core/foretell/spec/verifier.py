"""The one speculative verifier every drafter goes through.

Each round: the draft source proposes up to ``k`` tokens after the pending token (the
sequence's last, which the target has not consumed yet); one target forward over
``[pending, drafts...]`` scores every position; the longest acceptable prefix of drafts is
kept, plus one token the target chooses itself; caches roll back to exactly that. The
target decides every token (DESIGN.md invariant 1):

- greedy: a draft is kept while it equals the target's argmax, so the output is
  token-identical to plain greedy decoding;
- sampled, ``acceptance="rejection"`` (the default): draft ``d`` drawn from ``q`` is kept
  with probability ``min(1, p(d) / q(d))``; at the first rejection the target's token is
  drawn from ``max(p - q, 0)`` renormalized, and after a fully accepted draft from ``p``
  (Leviathan et al. 2023, Chen et al. 2023). ``p`` is exactly the distribution plain
  sampling draws from (:class:`~foretell.sampling.Sampler`), so the output distribution is
  plain sampling's;
- sampled, ``acceptance="token-match"``, and every seeded sampled request: the target
  samples each position itself, with the noise of that position's key (``RandomKeys.rows``,
  as plain decoding draws), and a draft is kept while it equals that sample. Exact, and the
  token at each position is then plain sampling's with that seed, whatever the drafter and
  the draft schedule: a seed reproduces the run. Drafters built on
  :class:`~foretell.spec.Drafting` draw a seeded request's drafts with the same noise, so
  they agree as often as a drafter that does not see ``p`` can (Daliri et al. 2024,
  "drafter-invariant speculative decoding"); rejection sampling accepts more, but its
  output depends on where drafts were offered.

One host sync per round: the accepted count, the target's token and the drafts come back
together. A round whose caches could not roll back (a wrapped ring without a reserve) is a
plain step, so such a request degrades to plain decoding and never corrupts its state.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx

from foretell.model import fixed
from foretell.model.kvcache import add_rollback_reserve, stay_trimmable, trim_all
from foretell.sampling import Sampler, decode_step
from foretell.spec.acceptance import distrust_message, judge_row
from foretell.spec.attach import start_source
from foretell.spec.contract import (
    PORT_HIDDEN,
    DraftError,
    Feed,
    Target,
    checked_draft,
    keep_recent_hidden,
)
from foretell.spec.policy import DraftLengthPolicy

if TYPE_CHECKING:
    from foretell.request import Progress, RequestState

log = logging.getLogger(__name__)

ACCEPTANCE_RULES = ("rejection", "token-match")


@attrs.frozen(kw_only=True)
class Speculator:
    """A prepared draft provider and how the verifier uses it."""

    kind: str
    provider: Any
    #: The most tokens drafted per round (``--num-draft-tokens``).
    max_tokens: int = 4
    #: Choose k per round from measured acceptance and cost; False drafts ``max_tokens``.
    adaptive: bool = True
    acceptance: str = attrs.field(default="rejection", validator=attrs.validators.in_(ACCEPTANCE_RULES))
    #: Who contributed the provider, for error messages.
    origin: str = ""
    #: Speculate on sampled requests too; False: those decode plainly, and only greedy ones
    #: speculate (``"sampled": false`` in a model's ``speculation.json``, where sampled
    #: drafting measured slower than plain decoding: docs/speculation.md).
    sampled: bool = True
    #: The draft-length policy, shared by this speculator's requests: what it measured of
    #: the machine and the drafter carries over, so only the first request pays the warm-up.
    policy: DraftLengthPolicy = attrs.field(init=False, eq=False, repr=False)

    @policy.default
    def _policy(self) -> DraftLengthPolicy:
        return DraftLengthPolicy(self.max_tokens, adaptive=self.adaptive)

    @property
    def wants_hidden(self) -> bool:
        return PORT_HIDDEN in frozenset(getattr(self.provider, "requires", ()))

    def label(self) -> str:
        return f"draft provider '{self.kind}'" + (f" from {self.origin}" if self.origin else "")


@attrs.define
class SpeculationStats:
    """What ``--json`` reports under ``speculation``."""

    drafter: str
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    produced: int = 0
    k_total: int = 0
    offered_at: list[int] = attrs.Factory(list)
    accepted_at: list[int] = attrs.Factory(list)
    #: Sequence tokens the drafter got back from the cache instead of computing them.
    draft_cached: int = 0

    def record(self, k: int, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.target_forwards += 1
        self.k_total += k
        self.drafted += drafted
        self.accepted += accepted
        self.produced += accepted + 1
        while len(self.offered_at) < drafted:
            self.offered_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.offered_at[i] += 1
            self.accepted_at[i] += i < accepted

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "acceptance_by_position": [
                a / o if o else 0.0 for a, o in zip(self.accepted_at, self.offered_at)
            ],
            "target_forwards": self.target_forwards,
            "tokens_per_target_forward": (
                self.produced / self.target_forwards if self.target_forwards else 0.0
            ),
            "mean_k": self.k_total / self.rounds if self.rounds else 0.0,
            "draft_cached_tokens": self.draft_cached,
        }


def speculative_steps(
    target: Target,
    speculator: Speculator,
    state: RequestState,
    sampler: Sampler,
    limit: int,
    stats: SpeculationStats,
    progress: Progress | None = None,
    *,
    after_prefill: Callable[[list[int], list[Any], int], None] | None = None,
    link: Any = None,
) -> Iterator[list[int]]:
    """Prefill both sides, then yield each round's tokens (accepted drafts + the target's).

    ``after_prefill(held tokens, caches, cached)`` runs once both sides hold the prompt (the
    prefix cache snapshots it there, with the drafter's state when ``link`` captures it).
    ``link`` (:class:`foretell.spec.attach.DraftLink`) restores the drafter from the state
    cached with the prefix and captures it again. A resumed request (``state.generated``
    non-empty) replays its tokens first, then speculates on if the drafter was restored."""
    model = target.model
    wants_hidden = speculator.wants_hidden
    prompt = state.prompt
    # Sliding-window layers keep enough history to undo a round (invariant 3).
    add_rollback_reserve(state.caches, speculator.max_tokens)
    resumed = len(state.generated)
    hidden = None
    if resumed:
        yield list(state.generated)
        limit -= resumed
        if limit <= 0:
            return
    else:
        hidden = state.prefill(model, prompt[state.cached : -1], progress,
                               keep_hidden=wants_hidden)
    source = _call(speculator, "open", speculator.provider.open, target, sampler)
    try:
        speculate, feed = start_source(speculator, source, state, hidden, link, after_prefill)
        stats.draft_cached = link.restored_tokens if link is not None else 0
        if not speculate:
            yield from state.plain_steps(model, sampler, limit)
            return
        yield from _rounds(model, speculator, source, state, sampler, limit, stats, link, feed)
    finally:
        _call(speculator, "close", source.close)


@attrs.define
class _Round:
    """One verify round in flight: what was fed and the lazy results of its one sync."""

    k: int
    n: int
    hidden: mx.array
    values: mx.array  # [accepted, chosen, flags, drafts...]


class _Verifier:
    """One request's rounds: draft, verify, accept, roll back, feed the source."""

    def __init__(self, model, speculator, source, state, sampler, stats):
        self.model, self.speculator, self.source = model, speculator, source
        self.state, self.sampler, self.stats = state, sampler, stats
        self.caches = state.caches
        self.policy = speculator.policy
        self.keys = sampler.keys()
        self.size = sampler.window
        self.wants_hidden = speculator.wants_hidden
        # A seed must reproduce the run, whose draft schedule follows measured timings.
        self.token_match = (speculator.acceptance == "token-match"
                            or sampler.config.seed is not None)
        sequence = state.prompt + state.generated
        self.recent = sequence[-self.size :] if self.size else []
        self.pending = sequence[-1]
        self.feed_tokens: list[int] = []
        self.feed_hidden: list[mx.array] = []
        if state.keys is None:  # a resumed generation continues its own stream
            state.keys = self.keys
        self.keys = state.keys
        self.fixed = fixed.fixed_for(model, "verify forward", _verify)
        self.vocab = model.vocab_size
        self.warned = 0  # the OUT_OF_VOCAB / NOT_A_DISTRIBUTION bits already reported

    def joined_feed_hidden(self) -> mx.array | None:
        return _join(self.feed_hidden) if self.wants_hidden else None

    # -- speculative rounds ---------------------------------------------------------------

    def launch(self, k: int) -> _Round | None:
        """Draft up to ``k`` tokens and queue their verification; None if nothing drafted."""
        position = len(self.state.prompt) + len(self.state.generated)  # the first draft's
        feed = Feed(self.feed_tokens, _join(self.feed_hidden) if self.wants_hidden else None,
                    position)
        draft = checked_draft(_call(self.speculator, "draft", self.source.draft, feed, k), k,
                              self.vocab, self.speculator.label())
        self.feed_tokens, self.feed_hidden = [], []
        if draft.size == 0:
            _call(self.speculator, "commit", self.source.commit, 0)
            return None
        # Start the drafter's work while the verify graph is built: MLX's CPU async_eval
        # returns only near a graph's end, so one eval would leave no overlap at all
        # (measured, paired, one speculator: MTP 1.22x -> 1.28x plain, two-model 1.32x -> 1.34x).
        mx.async_eval(draft.tokens)
        n = draft.size
        # Ids outside the vocabulary never reach the target's embedding: an in-range stand-in
        # runs there and the position counts as rejected (wide ints: no dtype overflows).
        wide = draft.tokens.astype(mx.int64)
        usable = mx.logical_and(wide >= 0, wide < self.vocab)
        window = mx.concatenate([mx.array([[self.pending]], dtype=mx.int32),
                                 mx.where(usable, wide, 0).astype(mx.int32)], axis=1)
        hidden, logits = self.verify_forward(window)
        values = judge_row(self.sampler, logits[0], window[0, 1:], usable[0], draft.q,
                           self.keys, position, token_match=self.token_match,
                           recent=self.recent)
        mx.async_eval(values)
        return _Round(k=k, n=n, hidden=hidden, values=values)

    def verify_forward(self, window: mx.array) -> tuple[mx.array, mx.array]:
        """The target's hidden states and logits over ``window``, compiled over fixed
        shapes where that is on (:mod:`foretell.model.fixed`) and the caches allow it."""
        out = None
        if self.fixed is not None:
            out = self.fixed(window, caches=self.caches, length=window.shape[1])
        return out if out is not None else _verify(self.model, window, self.caches)

    def finish(self, round_: _Round) -> list[int]:
        """The round's one host sync; roll back to the accepted prefix."""
        values = round_.values.tolist()
        a, token, flags = values[0], values[1], values[2]
        if flags & ~self.warned:
            self._warn(flags & ~self.warned)
        kept = values[3 : 3 + a] + [token]
        trim_all(self.caches, round_.n - a)
        _call(self.speculator, "commit", self.source.commit, a)
        self.stats.record(round_.k, round_.n, a)
        self._extend(kept, round_.hidden[:, : a + 1] if self.wants_hidden else None)
        return kept

    def _warn(self, flags: int) -> None:
        """Once a request for each kind: the drafter returned what the verifier rejected."""
        self.warned |= flags
        log.warning("%s", distrust_message(self.speculator.label(), flags, self.vocab))

    def abandon(self, round_: _Round) -> None:
        """A queued round nobody will read: its drafts leave the caches."""
        trim_all(self.caches, round_.n)
        _call(self.speculator, "commit", self.source.commit, 0)

    def _extend(self, kept: list[int], hidden: mx.array | None) -> None:
        self.feed_tokens.extend(kept)
        if hidden is not None:
            self.feed_hidden.append(hidden)
            keep_recent_hidden(self.feed_hidden)
        if self.size:
            self.recent = (self.recent + kept)[-self.size :]
        self.pending = kept[-1]
        self.state.generated.extend(kept)

    # -- plain stretches ------------------------------------------------------------------

    def plain_run(self, limit: int, count: int,
                  after: Callable[[int], int]) -> Iterator[list[int]]:
        """Plain decoding steps, each queued before the last one is read (as plain decoding
        does), until ``limit`` tokens or ``after`` ends the run. ``after(done)`` is asked
        once ``count`` tokens have been read, with the next step already queued, and then
        again after as many more as it answers; 0 makes that queued step the run's last.
        So consecutive stretches stay pipelined and a request whose drafter is switched off
        decodes as plain decoding does. The drafter hears of these tokens in its next feed."""
        step = decode_step(self.model, self.caches, self.sampler, self.keys, self.recent,
                           len(self.state.prompt) + len(self.state.generated))

        token, hidden = step(mx.array([[self.pending]], dtype=mx.int32))
        mx.async_eval(token)
        done, ask_at, ending = 0, count, False
        while True:
            done += 1
            following = None
            if done < limit and not ending:
                following = step(token[:, None])
                mx.async_eval(following[0])
            value = token.item()
            self.stats.record(0, 0, 0)
            self._extend([value], hidden if self.wants_hidden else None)
            if following is not None and done == ask_at:
                more = after(done)
                ending, ask_at = more <= 0, done + more
            yield [value]
            if following is None:
                return
            if done % 256 == 0:
                mx.clear_cache()
            token, hidden = following


def _rounds(
    model: Any,
    speculator: Speculator,
    source: Any,
    state: RequestState,
    sampler: Sampler,
    limit: int,
    stats: SpeculationStats,
    link: Any = None,
    feed: tuple[list[int], mx.array | None] | None = None,
) -> Iterator[list[int]]:
    """Rounds until ``limit`` tokens; the next round is queued before this one's tokens are
    handed out, so the caller's streaming overlaps the device's work. ``feed``: what a
    restored source has not heard yet; ``link`` is told of every round boundary."""
    v = _Verifier(model, speculator, source, state, sampler, stats)
    if feed is not None:
        v.feed_tokens, v.feed_hidden = list(feed[0]), [feed[1]] if feed[1] is not None else []
    produced = 0
    in_flight: _Round | None = None

    def choose(remaining: int) -> int:
        # Drafting past max_tokens is wasted; drafting past what caches can undo is unsafe.
        k = v.policy.choose(remaining)
        return k if k and stay_trimmable(v.caches, k + 1) else 0

    last = time.perf_counter()
    traces = fixed.trace_count()  # a round that traced a new shape is not timed
    wanted = False  # the last choice asked for drafts (and the drafter may have had none)
    #: The length already chosen for the next round (by the last round, or by a plain run
    #: that ended to draft); None: ask the policy. Asking again would take a second choice
    #: and drop the first: a plain stretch the policy asked for right after a drafted round
    #: (its probe of what a plain step costs now) never ran.
    chosen: int | None = None
    #: Tokens of the current plain run timed from so far. A run's first step is never
    #: timed: it starts with nothing queued ahead of it (it pays for switching from
    #: drafting), which the steps after it do not; counted in, it nearly doubled the
    #: plain-step estimate and kept drafters on at a loss (docs/decisions.md).
    timed = 0

    def after_stretch(done: int) -> int:
        """A plain stretch ended (its ``done``-th token read, one more queued): time it,
        then say how many plain steps follow before asking again, or 0 to end the run after
        the queued step (to draft, or to checkpoint with nothing in flight)."""
        nonlocal last, chosen, timed
        now = time.perf_counter()
        if timed:  # (a single first step, after a drafter had nothing, is not timed)
            v.policy.observe(0, 0, (now - last) / (done - timed))
        last, timed = now, done
        if link is not None and link.due(v):
            return 0
        # The run has handed out done - 1 tokens (``produced`` counts them); this one and
        # the queued one follow before the next round.
        k = choose(limit - produced - 3)
        chosen = k or None
        return 0 if k else v.policy.stretch

    try:
        while produced < limit:
            if in_flight is None:
                k = chosen if chosen is not None else choose(limit - produced - 1)
                chosen = None
                wanted = k > 0
                in_flight = v.launch(k) if k else None
            if in_flight is None:
                # A plain run when drafting does not pay, asking again after each stretch;
                # its first stretch is a single step when the drafter merely had nothing
                # (prompt lookup without a match may have one next token).
                timed, last = 0, time.perf_counter()
                run = v.plain_run(limit - produced, 1 if wanted else v.policy.stretch,
                                  after_stretch)
                for tokens in run:
                    produced += 1
                    if not timed:  # the run's first step: time from here on
                        timed, last = 1, time.perf_counter()
                    yield tokens
                last = time.perf_counter()
                if link is not None:
                    link.boundary(v)
                continue
            round_, in_flight = in_flight, None
            kept = v.finish(round_)
            now = time.perf_counter()
            seen, traces = traces, fixed.trace_count()
            v.policy.observe(round_.n, len(kept) - 1, now - last, one_off=traces != seen)
            last = now
            produced += len(kept)
            if link is not None:
                link.boundary(v)
            if produced < limit:
                k = choose(limit - produced - 1)
                wanted = k > 0
                if k:
                    in_flight = v.launch(k)
                else:
                    chosen = 0  # plain steps next, as the policy said
            yield kept
            if stats.rounds % 256 == 0:
                mx.clear_cache()
    finally:
        if in_flight is not None:
            v.abandon(in_flight)
        if link is not None:
            link.closing(v)


def _verify(model: Any, window: mx.array, caches: list[Any]) -> tuple[mx.array, mx.array]:
    hidden, _ = model.forward(window, caches)
    return hidden, model.logits(hidden)


def _join(parts: list[mx.array]) -> mx.array | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)


def _call(speculator: Speculator, what: str, fn: Any, *args: Any) -> Any:
    """Call into the drafter plugin; its failure ends this request with its name on it."""
    try:
        return fn(*args)
    except DraftError:
        raise
    except Exception as exc:
        raise DraftError(
            f"{speculator.label()} failed in {what}(): {type(exc).__name__}: {exc}"
        ) from exc


def make_speculator(
    registry: Any,
    target: Target,
    kind: str,
    options: Any = None,
    *,
    max_tokens: int | None = None,
    adaptive: bool = True,
    acceptance: str = "rejection",
    sampled: bool = True,
) -> Speculator:
    """Build, check and prepare the draft provider registered as ``kind`` for ``target``;
    ``max_tokens`` None drafts the provider's own preferred length (:func:`preferred_tokens`);
    ``sampled`` False leaves sampled requests to plain decoding.

    A pairing that cannot work is refused here, before any draft weights are allocated.
    """
    from foretell.plugin.registry import Kind
    from foretell.spec.contract import PairingError, missing_ports, preferred_tokens

    contribution = registry.get(Kind.DRAFT, kind)
    factory = contribution.load()
    origin = contribution.origin.describe()
    if options is None and contribution.config is not None:
        options = contribution.config()
    try:
        provider = factory(options) if contribution.config is not None else factory()
    except Exception as exc:
        raise DraftError(
            f"draft provider '{kind}' from {origin}: cannot be built: {type(exc).__name__}: {exc}"
        ) from exc
    missing = missing_ports(provider, target)
    if missing:
        raise PairingError(
            f"draft provider '{kind}' cannot draft for target {target.name}: it needs "
            f"{', '.join(sorted(missing))}, which the target ({target.model.model_type}) "
            "does not offer"
        )
    label = f"draft provider '{kind}' from {origin}"
    speculator = Speculator(
        kind=kind, provider=provider, max_tokens=max_tokens or preferred_tokens(provider, label),
        adaptive=adaptive, acceptance=acceptance, origin=origin, sampled=sampled,
    )
    try:
        provider.prepare(target)
    except (PairingError, DraftError):
        raise
    except Exception as exc:
        raise DraftError(
            f"{speculator.label()} failed in prepare(): {type(exc).__name__}: {exc}"
        ) from exc
    return speculator

