"""Per-row speculation over a batch: one target forward verifies every row's draft.

:func:`verify_rows` runs the target over ``[pending, drafts...]`` for every row (a shorter
draft padded), judges each row by its own request's rule (greedy or token-match with the
row's position keys, or rejection sampling), rolls each row's KV back to its accepted
prefix and hands back each row's kept tokens; a row with no draft gets exactly its plain
decoding step; on CUDA a lone row's window runs compiled over fixed shapes
(:mod:`foretell.model.fixed`). :class:`SourceRows` lets a per-request (plugin API 1) drafter
serve rows. :class:`DraftGroup` is one drafter's rows in the batch, reading the hidden states
its rows need from the batch's :class:`~foretell.spec.step_hidden.StepHidden`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx

from foretell.model.batch import layer_caches
from foretell.model.fixed import fixed_or_ordinary
from foretell.sampling import RandomKeys, Sampler
from foretell.spec.acceptance import judge_row
from foretell.spec.contract import (
    Draft,
    DraftState,
    Feed,
    Target,
    checked_draft,
    keep_recent_hidden,
)
from foretell.spec.rows import RowDraft, RowStart, checked_lengths
from foretell.spec.step_hidden import StepHidden, joined_states


@attrs.frozen(kw_only=True)
class RowRule:
    """How one row's draft is judged: its request's sampler and random keys, the sequence
    position its first draft would take, and its recent tokens (the repetition penalty's)."""

    sampler: Sampler
    keys: RandomKeys | None
    position: int
    recent: Sequence[int] = ()
    token_match: bool = False
    #: ``bool [vocab]``: the only tokens a row without a draft may take (a constraint's).
    allowed: mx.array | None = None
    #: Report the row's raw log-probabilities (rows without a draft).
    logprobs: bool = False


@attrs.frozen
class RowsVerified:
    """Each row's kept tokens (accepted drafts, then the target's), its accepted count, and
    the target's hidden states ``[B, 1 + n_max, H]`` (row ``b``'s first ``accepted[b] + 1``
    are the states that predicted its kept tokens)."""

    kept: list[list[int]]
    accepted: list[int]
    hidden: mx.array
    #: Per row, :data:`~foretell.spec.acceptance.OUT_OF_VOCAB` /
    #: :data:`~foretell.spec.acceptance.NOT_A_DISTRIBUTION` bits: what its drafter returned
    #: that the rules rejected (0: nothing).
    distrusted: list[int]
    #: Row -> its ``[vocab]`` raw log-probabilities, for rows whose rule asked.
    logprobs: dict[int, mx.array] = attrs.Factory(dict)


def verify_rows(model: Any, caches: list[Any], pending: Sequence[int], draft: RowDraft,
                lengths: Sequence[int], rules: Sequence[RowRule]) -> RowsVerified:
    """Verify ``draft`` (its rows capped at ``lengths``) after each row's ``pending`` token
    in one forward through the batch ``caches``, then roll every row back to what it kept."""
    width = draft.tokens.shape[1] if lengths and max(lengths) else 0
    tokens = draft.tokens[:, :width].astype(mx.int64)
    vocab = model.vocab_size
    usable = mx.logical_and(tokens >= 0, tokens < vocab)
    window = mx.concatenate([mx.array(pending, dtype=mx.int32)[:, None],
                             mx.where(usable, tokens, 0).astype(mx.int32)], axis=1)
    # On CUDA a lone row's window replays over fixed shapes (foretell.model.fixed).
    hidden, logits = fixed_or_ordinary(model, "verify forward", _verify, window,
                                       caches=layer_caches(caches))  # [B, 1 + width, V]
    results, reported = [], {}
    for b, rule in enumerate(rules):
        n = lengths[b]
        row_logits = logits[b, : n + 1]
        if rule.logprobs:
            reported[b] = row_logits[0] - mx.logsumexp(row_logits[0])
        if rule.allowed is not None and n == 0:
            row_logits = mx.where(rule.allowed, row_logits,
                                  mx.array(-mx.inf, row_logits.dtype))
        q = draft.q[b : b + 1, :n] if draft.q is not None else None
        results.append(judge_row(rule.sampler, row_logits, window[b, 1 : 1 + n],
                                 usable[b, :n], q, rule.keys, rule.position,
                                 token_match=rule.token_match, recent=rule.recent))
    mx.eval(results)  # the round's one host sync
    values = [r.tolist() for r in results]
    accepted = [v[0] for v in values]
    kept = [v[3 : 3 + v[0]] + [v[1]] for v in values]
    for cache in caches:
        cache.trim([width - a for a in accepted])
    return RowsVerified(kept, accepted, hidden, [v[2] for v in values], reported)


def _verify(model: Any, window: mx.array, caches: list[Any]) -> tuple[mx.array, mx.array]:
    hidden, _ = model.forward(window, caches)
    return hidden, model.logits(hidden)


class SourceRows:
    """A per-request drafter (plugin API 1: ``provider.open(target, sampler)`` sources)
    serving rows: each row drafts with its own source, one after another."""

    def __init__(self, provider: Any, target: Target, label: str) -> None:
        self.provider, self.target, self.label = provider, target, label
        self.sources: list[Any] = []
        #: Per row, what it was fed in rounds it did not draft (a source hears a feed only
        #: when it drafts: it gets these then, before the newer feed).
        self._unheard: list[Feed | None] = []
        self._drafted: list[int] = []

    def append(self, rows: Sequence[RowStart]) -> None:
        opened: list[Any] = []
        try:  # every row's source is ready before any joins (DraftRows.append)
            for row in rows:
                source = self.provider.open(self.target, row.sampler)
                opened.append(source)
                if row.state is not None and hasattr(source, "restore"):
                    source.restore(row.state, list(row.state_tokens))
                    rest = list(row.feed.tokens[len(row.state_tokens) :])
                    if rest:
                        source.prefill(Feed(rest, row.feed.hidden))
                else:
                    source.prefill(row.feed)
        except BaseException:
            for source in opened:
                with contextlib.suppress(Exception):  # the first error is the one to report
                    source.close()
            raise
        self.sources.extend(opened)
        self._unheard.extend([None] * len(opened))

    def filter(self, keep: Sequence[int]) -> None:
        kept = set(keep)
        for i, source in enumerate(self.sources):
            if i not in kept:
                source.close()
        self.sources = [self.sources[i] for i in keep]
        self._unheard = [self._unheard[i] for i in keep]

    def draft(self, feeds: Sequence[Feed], lengths: Sequence[int]) -> RowDraft:
        drafts: list[Draft | None] = []
        self._drafted = []
        for b, (source, feed, n) in enumerate(zip(self.sources, feeds, lengths)):
            feed = _after(self._unheard[b], feed)
            if n == 0:
                self._unheard[b] = feed
                drafts.append(None)
                continue
            self._unheard[b] = None
            draft = checked_draft(source.draft(feed, n), n, self.target.model.vocab_size,
                                  self.label)
            self._drafted.append(b)
            drafts.append(draft)
        width = max((d.size for d in drafts if d is not None), default=0)
        rows, qs = [], []
        sampled = any(d is not None and d.q is not None for d in drafts)
        for d in drafts:
            size = 0 if d is None else d.size
            tokens = d.tokens[:1] if d is not None else mx.zeros((1, 0), mx.int32)
            rows.append(mx.pad(tokens.astype(mx.int32), [(0, 0), (0, width - size)]))
            if sampled:
                qs.append(_row_q(d, width, self.target.model.vocab_size))
        tokens = mx.concatenate(rows, axis=0) if rows else mx.zeros((0, 0), mx.int32)
        q = mx.concatenate(qs, axis=0) if sampled else None
        return RowDraft(tokens, tuple(0 if d is None else d.size for d in drafts), q)

    def commit(self, accepted: Sequence[int]) -> None:
        for b in self._drafted:
            self.sources[b].commit(accepted[b])
        self._drafted = []

    def capture(self, row: int) -> DraftState | None:
        capture = getattr(self.sources[row], "capture", None)
        return capture() if capture is not None else None

    def close(self) -> None:
        for source in self.sources:
            source.close()
        self.sources, self._unheard = [], []


def _after(earlier: Feed | None, feed: Feed) -> Feed:
    """``feed`` preceded by an ``earlier`` one the source did not hear (hidden states
    trimmed to what a drafter reads, :func:`~foretell.spec.contract.keep_recent_hidden`)."""
    if earlier is None:
        return feed
    hidden = None
    if earlier.hidden is not None or feed.hidden is not None:
        parts = [h for h in (earlier.hidden, feed.hidden) if h is not None]
        keep_recent_hidden(parts)
        hidden = joined_states(parts)
    return Feed(list(earlier.tokens) + list(feed.tokens), hidden, feed.position)


def _row_q(draft: Draft | None, width: int, vocab: int) -> mx.array:
    """``[1, width, vocab]``: the draft's q, a point mass where it chose deterministically,
    zeros past its length (never read: lengths cap every row)."""
    if draft is None or draft.size == 0:
        return mx.zeros((1, width, vocab), mx.float32)
    q = draft.q[:1] if draft.q is not None else (
        mx.arange(vocab)[None, None, :] == draft.tokens[:1, :, None]).astype(mx.float32)
    return mx.pad(q.astype(mx.float32), [(0, 0), (0, width - draft.size), (0, 0)])

class DraftGroup:
    """The rows of a batch one drafter serves, in batch order: its :class:`DraftRows` row
    ``i`` is ``members[i]``, a request row with ``state`` (prompt, generated), ``sampler``,
    ``unread`` (its newest token is not in ``state.generated`` yet) and, until it joins, its
    prompt's hidden states (``feed_hidden``) for a drafter reading them. What a member's
    drafter has not heard is read when it is fed (it drafts, or its state is captured): the
    tokens its sequence gained since, and their hidden states from ``steps`` (the batch's
    :class:`StepHidden`, which its steps record), so a step it does not draft at costs it
    nothing.

    A row whose drafter would prefill its whole sequence (no state restored for it) waits
    ``dormant`` until it is first asked to draft: where the batch decodes plainly (a large
    batch, a GPU whose draft forward costs what the target's does) that prefill is never
    paid, elsewhere it is paid after the request's first token. It then hears its sequence
    so far, or (a drafter reading hidden states) its prompt with their states, kept until
    then, and the tokens since as a member that had not drafted since it joined."""

    def __init__(self, speculator: Any, target: Any, *, per_request: bool = False,
                 steps: StepHidden | None = None) -> None:
        self.speculator = speculator
        provider = speculator.provider
        label = speculator.label()
        #: Where its rows' hidden states are read (None: its drafter reads none).
        self.steps = (steps or StepHidden()) if speculator.wants_hidden else None
        opener = None if per_request else getattr(provider, "open_rows", None)
        self.rows = opener(target) if opener is not None else SourceRows(provider, target, label)
        self.members: list[Any] = []
        #: Rows joined whose drafter has not been fed yet (the class docstring).
        self.dormant: list[Any] = []
        #: How many dormant rows the last :meth:`draft` fed their sequences (a one-off cost),
        #: and the rows it could not, each with what its drafter raised (they leave the group).
        self.woken = 0
        self.refused: list[tuple[Any, Exception]] = []
        #: A dormant row whose drafter reads hidden states: its start as it joined (the
        #: prompt's states) and its feed's place then (generated tokens heard, step serial).
        self._held: dict[int, tuple[RowStart, int, int]] = {}
        #: Per member: how many of its generated tokens its drafter has heard, and the first
        #: step (a :attr:`StepHidden.serial`) whose hidden states it has not.
        self._heard: list[int] = []
        self._since: list[int] = []
        self._drafted = False

    def add(self, rows: Sequence[Any], links: Sequence[Any] | None = None,
            fed: Sequence[bool] | None = None) -> list[bool | Exception]:
        """Rows ``rows`` join, in one :meth:`DraftRows.append` (one prefill for all of them,
        where the drafter batches it), each restored from the drafter state the cache tier
        found with its prefix (``links[i]``: its :class:`~foretell.spec.attach.DraftLink`)
        where that fits, else prefilled with its sequence: now where ``fed[i]`` (its state
        is to be stored with its prompt; a hidden-state drafter's always is where there is a
        link: a hit without it could not speculate), else once it first drafts. Per row:
        True (joined), False (nothing joined: it cannot speculate, a hidden-state drafter
        over a cached prefix with no state of its own to restore, whose hidden states were
        never computed here), or the exception its drafter raised (nothing joined)."""
        outcome: list[bool | Exception] = [False] * len(rows)
        starts: dict[int, RowStart] = {}
        for i, row in enumerate(rows):
            try:
                start = self._start(row, links[i] if links is not None else None)
            except Exception as exc:  # noqa: BLE001 - reported per row, as append's errors
                outcome[i] = exc
                continue
            now = (fed is not None and fed[i]) or (
                self.steps is not None and links is not None and links[i] is not None)
            if start is not None and start.state is None and not now:
                self.dormant.append(row)
                if self.steps is not None:
                    self._held[id(row)] = (start, len(row.state.generated), self.steps.serial)
                outcome[i] = True
            elif start is not None:
                starts[i] = start
        errors = self._feed([rows[i] for i in starts], list(starts.values()))
        for i, error in zip(starts, errors):
            outcome[i] = True if error is None else error
        return outcome

    def _feed(self, rows: Sequence[Any], starts: Sequence[RowStart]) -> list[Exception | None]:
        """Rows ``rows`` start in the drafter's rows with ``starts``: in one
        :meth:`DraftRows.append` where it takes them all, else one by one, so only a row its
        drafter refuses stays out. Per row, what its drafter raised (None: it joined)."""
        if len(starts) > 1:
            try:
                self.rows.append(list(starts))
            except Exception:  # noqa: BLE001 - none joined: one by one, to tell who failed
                pass
            else:
                for row in rows:
                    self._joined(row)
                return [None] * len(rows)
        errors: list[Exception | None] = []
        for row, start in zip(rows, starts):
            try:
                self._append_one(start)
            except Exception as exc:  # noqa: BLE001 - this row decodes plainly
                errors.append(exc)
                continue
            self._joined(row)
            errors.append(None)
        return errors

    def _start(self, row: Any, link: Any) -> RowStart | None:
        """Row ``row``'s :class:`RowStart`, or None when it cannot speculate (:meth:`add`)."""
        from foretell.spec.drafting import draft_keys

        wants_hidden = self.speculator.wants_hidden
        hidden = joined_states(row.feed_hidden) if wants_hidden else None
        slot = _Slot()
        restored = None
        state = row.state
        # A resumed row's sequence runs on past its prompt; its entry (the checkpoint) ends
        # where its caches do.
        sequence = state.prompt + state.generated
        if link is not None:
            restored = link.restore(slot, sequence,
                                    state.held if state.generated else state.cached)
        if restored is not None and wants_hidden:
            hidden = joined_states([h for h in (restored[1], hidden) if h is not None and h.size])
        if restored is None and wants_hidden and state.cached:
            return None
        return RowStart(feed=Feed(sequence, hidden), sampler=row.sampler,
                        keys=draft_keys(row.sampler), state=slot.state,
                        state_tokens=slot.tokens)

    def _append_one(self, start: RowStart) -> None:
        try:
            self.rows.append([start])
        except Exception as exc:
            if start.state is None or self.speculator.wants_hidden:
                raise
            # The state did not fit after all: start over from the prompt.
            logging.getLogger("foretell.spec").warning(
                "%s failed in restore(): %s: %s; it prefills the prompt instead",
                self.speculator.label(), type(exc).__name__, exc)
            self.rows.append([attrs.evolve(start, state=None, state_tokens=())])

    @property
    def serves(self) -> list[Any]:
        """Every row of this drafter, fed or dormant."""
        return [*self.members, *self.dormant]

    def _wake(self, rows: Sequence[Any]) -> None:
        """Dormant rows ``rows`` join the drafter's rows as :meth:`add` starts a row with no
        state to restore: with their sequences so far, or as they joined (the class
        docstring)."""
        for row in rows:
            self.dormant.remove(row)
        errors = self._feed(rows, [self._held[id(row)][0] if id(row) in self._held
                                   else self._start(row, None) for row in rows])
        for row, error in zip(rows, errors):
            if error is not None:
                self._held.pop(id(row), None)
                self.refused.append((row, error))
        self.woken = errors.count(None)

    def _joined(self, row: Any) -> None:
        """Row ``row`` is a member now; its feed goes on from here, or, woken with its start
        as it joined (``_held``), from there."""
        held = self._held.pop(id(row), None)
        self.members.append(row)
        self._heard.append(len(row.state.generated) if held is None else held[1])
        self._since.append(held[2] if held is not None else
                           self.steps.serial if self.steps is not None else 0)

    def _feed_of(self, i: int, unread: bool = False) -> tuple[list[int], mx.array | None]:
        """Member ``i``'s tokens its drafter has not heard and, for a hidden-state drafter,
        their newest hidden states (``unread``: the newest state kept is its unread
        token's)."""
        member = self.members[i]
        tokens = member.state.generated[self._heard[i] :]
        if self.steps is None:
            return tokens, None
        return tokens, self.steps.newest([(member, self._since[i], len(tokens), unread)])[0]

    def attachment(self, row: Any, link: Any, state: Any) -> Any:
        """Row ``row``'s drafter state as the cache tier stores it with ``state``'s caches
        (:meth:`~foretell.spec.attach.DraftLink.capture`), or None."""
        i = self.members.index(row)
        tokens, hidden = self._feed_of(i, row.unread)
        return link.capture(_Slot(self.rows, i), state, tokens, hidden)

    def draft(self, rows: Sequence[Any], lengths: list[int]
              ) -> dict[int, tuple[mx.array, mx.array | None, int]]:
        """``{batch row: (tokens [1, n], q [1, n, V] or None, n)}`` for this group's rows
        (every row's pending token on the host)."""
        where = {id(row): b for b, row in enumerate(rows)}
        self.woken = 0
        waking = [row for row in self.dormant if lengths[where[id(row)]]]
        if waking:
            self._wake(waking)
        index = [where[id(member)] for member in self.members]
        asked = [lengths[b] for b in index]
        self._drafted = any(asked)
        if not self._drafted:
            return {}
        heard = [len(member.state.generated) for member in self.members]
        tokens = [member.state.generated[h:] for member, h in zip(self.members, self._heard)]
        hidden: list[mx.array | None] = [None] * len(self.members)
        if self.steps is not None:
            hidden = self.steps.newest([
                (member, since, len(t), False)
                for member, since, t in zip(self.members, self._since, tokens)])
        feeds = [Feed(t, h, len(member.state.prompt) + n)
                 for member, t, h, n in zip(self.members, tokens, hidden, heard)]
        draft = self.rows.draft(feeds, asked)
        got = checked_lengths(draft, asked, self.speculator.label())
        # Every row took its feed, drafting or not.
        self._heard = heard
        if self.steps is not None:
            self._since = [self.steps.serial] * len(self.members)
        return {b: (draft.tokens[i : i + 1],
                    draft.q[i : i + 1] if draft.q is not None else None, n)
                for i, (b, n) in enumerate(zip(index, got))}

    def commit(self, rows: Sequence[Any], accepted: Sequence[int],
               lengths: Sequence[int]) -> None:
        if not self._drafted:
            return
        where = {id(row): b for b, row in enumerate(rows)}
        self.rows.commit([accepted[where[id(m)]] if lengths[where[id(m)]] else 0
                          for m in self.members])
        self._drafted = False

    def error(self, what: str, exc: BaseException) -> BaseException:
        """``exc``, raised by this group's drafter in ``what``, as the
        :class:`~foretell.errors.DraftError` naming the drafter."""
        from foretell.errors import DraftError

        if isinstance(exc, DraftError):
            return exc
        error = DraftError(f"{self.speculator.label()} failed in {what}(): "
                           f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error

    def leave(self, gone: set[int]) -> None:
        self.dormant = [row for row in self.dormant if id(row) not in gone]
        for key in gone:
            self._held.pop(key, None)
        keep = [i for i, member in enumerate(self.members) if id(member) not in gone]
        if len(keep) != len(self.members):
            self.rows.filter(keep)
            self.members = [self.members[i] for i in keep]
            self._heard = [self._heard[i] for i in keep]
            self._since = [self._since[i] for i in keep]


class _Slot:
    """One row of a :class:`DraftRows` as the cache link sees a per-request source:
    ``restore`` keeps the state for the row's :class:`RowStart`, ``capture`` captures it."""

    def __init__(self, rows: Any = None, index: int = 0) -> None:
        self.rows, self.index = rows, index
        self.state: DraftState | None = None
        self.tokens: Sequence[int] = ()

    def restore(self, state: DraftState, tokens: Sequence[int]) -> None:
        self.state, self.tokens = state, list(tokens)

    def capture(self) -> DraftState | None:
        return self.rows.capture(self.index)

    # The rest of a source's contract: the rows do the drafting.
    def prefill(self, feed: Feed) -> None: ...

    def draft(self, feed: Feed, n: int) -> Draft: ...

    def commit(self, accepted: int) -> None: ...

    def close(self) -> None: ...


def combined_draft(drafted: dict[int, tuple[mx.array, mx.array | None, int]],
                   rows: Sequence[Any], vocab: int) -> tuple[RowDraft, list[int]]:
    """The groups' drafts (``{id(row): (tokens [1, n], q or None, n)}``, as
    :meth:`DraftGroup.draft` returns them keyed by row) as one ``[B, n_max]``
    :class:`RowDraft` over the batch's ``rows`` (a row no group drafted for: length 0), and
    the lengths drafted."""
    parts: dict[int, tuple[mx.array, mx.array | None]] = {}
    lengths = [0] * len(rows)
    for b, row in enumerate(rows):
        if id(row) in drafted:
            row_tokens, row_q, lengths[b] = drafted[id(row)]
            parts[b] = (row_tokens, row_q)
    width = max(lengths, default=0)
    if not width:
        return RowDraft(mx.zeros((len(rows), 0), mx.int32), tuple(lengths)), lengths
    sampled = any(q is not None for _, q in parts.values())
    token_rows, q_rows = [], []
    for b, n in enumerate(lengths):
        row_tokens, row_q = parts.get(b, (mx.zeros((1, 0), mx.int32), None))
        row_tokens = row_tokens[:, :n].astype(mx.int32)
        token_rows.append(mx.pad(row_tokens, [(0, 0), (0, width - n)]))
        if sampled:
            q_rows.append(_row_q(Draft(row_tokens, row_q[:, :n] if row_q is not None else None),
                                 width, vocab))
    q = mx.concatenate(q_rows, axis=0) if sampled else None
    return RowDraft(mx.concatenate(token_rows, axis=0), tuple(lengths), q), lengths
