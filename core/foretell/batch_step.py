"""The scheduler's step: one forward over every running row (:mod:`foretell.scheduler`).

Each step either runs pipelined plain decoding for every row (the next tokens drawn on the
device before this step's are read, as single-request decoding does) or, where a row drafts
or needs its token on the host, settles the pipeline and verifies every row's draft in one
forward (:func:`foretell.spec.batch.verify_rows`); then each row's kept tokens are committed
and streamed. How far rows draft is chosen here too: a row running alone by its speculator's
own length policy, a batch by :class:`~foretell.spec.batch_policy.BatchDraftPolicy`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx

from foretell.model.batch import batch_caches, layer_caches
from foretell.model.fixed import trace_count
from foretell.model.kvcache import KVCache, trim_all
from foretell.request import prefill_rows, release_buffers
from foretell.spec.contract import keep_recent_hidden
from foretell.spec.step_hidden import StepHidden
from foretell.stream import END, TokenLogprobs

log = logging.getLogger("foretell.scheduler")

if TYPE_CHECKING:
    from foretell.scheduler import _Row
    from foretell.spec import Speculator
    from foretell.spec.batch import DraftGroup


class BatchStep:
    """The step half of :class:`~foretell.scheduler.Scheduler` (and its shared prefill
    forward), which owns the state it reads: the running rows (``_rows``), their batch caches (``_batch``), the pipelined
    tokens (``_tokens``), the drafter groups (``_groups``, made by ``_group``), the batch
    policy (``_policy``), the finished rows still to store (``_stores``), and ``_remove`` and
    ``_fail``."""

    engine: Any
    _rows: list[_Row]
    _batch: list[Any] | None
    _tokens: mx.array | None
    _groups: dict[tuple[int, bool], DraftGroup]
    _policy: Any
    _warned: dict[str, int]
    _prefilling: Any
    _waiting: Any
    _queued: int
    _stores: list[tuple[_Row, Any]]
    #: The rows (by id) the last step ran over, when it was a pipelined plain step; None
    #: after a synchronous step. A pipelined step's time is its wait for the step before
    #: it, so it is a plain step's cost only when that step was one over the same rows.
    _plain_rows: tuple[int, ...] | None = None
    #: The target's hidden states of the last steps, for rows whose drafter reads them
    #: (made on first use: :meth:`_hidden_steps`).
    _steps_hidden: StepHidden | None = None
    #: ``(rows, policy version, rates, adaptive, top)``: :meth:`_row_rates`' last answer.
    _rates_known: tuple[Any, ...] | None = None
    #: Whether the last row running alone chose to draft (as if so before any did).
    _alone_drafting: bool = True

    def _step(self) -> None:
        """One forward over every running row. While no row drafts and none needs its last
        token on the host, the step is pipelined (:meth:`_plain_step`); otherwise each
        speculating row's draft is verified and each other row takes its plain step, with the
        step's one host sync, then per-row commit and streaming."""
        from foretell.spec.batch import RowRule, combined_draft, verify_rows

        lengths = self._choose_lengths(self._rows)
        if not any(lengths) and all(row.pipelined for row in self._rows):
            self._plain_step()
            return
        chosen = dict(zip(map(id, self._rows), lengths))
        self._plain_rows = None
        self._settle()  # rows may end here; the others keep their lengths, within max_tokens
        rows = self._rows
        if not rows:
            return
        lengths = [min(chosen[id(row)], self._cap(row)) for row in rows]
        traces, started = trace_count(), time.perf_counter()
        drafted = self._draft(rows, lengths)
        asked = dict(zip(map(id, rows), lengths))
        rows = self._rows  # rows whose drafter failed have left
        if not rows:
            return
        draft, lengths = combined_draft(drafted, rows, self.engine.model.vocab_size)
        if any(lengths):  # the drafters compute while the verify graph is built, as alone
            mx.async_eval(draft.tokens)
        rules = []
        for row in rows:
            state, speculator, sampler = row.state, row.speculator, row.sampler
            n = sampler.window  # only the penalty's window of the sequence, not a copy of it
            rules.append(RowRule(
                sampler=sampler, keys=row.keys,
                position=len(state.prompt) + len(state.generated),
                recent=(state.prompt[-n:] + state.generated[-n:])[-n:] if n else (),
                token_match=sampler.config.seed is not None or (
                    speculator is not None and speculator.acceptance == "token-match"),
                allowed=row.constraint.allowed() if row.constraint is not None else None,
                logprobs=row.logprobs is not None))
        done = verify_rows(self.engine.model, self._batch, [row.pending for row in rows],
                           draft, lengths, rules)
        elapsed = time.perf_counter() - started
        if self._keeps_hidden():
            self._hidden_steps().record(
                done.hidden, rows, [len(kept) for kept in done.kept] if any(lengths) else None)
        # A step that traced a fixed-shape forward (foretell.model.fixed) paid a one-off cost.
        # So did one whose drafters first fed rows their sequences (DraftGroup.dormant):
        # the batch policy learns what that adds (a look over such rows pays it).
        woken = sum(group.woken for group in self._groups.values())
        traced = trace_count() != traces
        one_off = traced or woken > 0
        # The width asked for is what this step cost, drafted or not (a drafter's search
        # that found nothing took its time too).
        width = max(asked.values(), default=0)
        if woken:
            self._policy.woke(woken, len(rows), width, elapsed)
        self._policy.observe(len(rows), width, None if one_off else elapsed)
        if len(rows) == 1 and self._alone(rows[0]):
            # A drafter that found nothing to draft (a lookup without a match) ran a round
            # that kept nothing: told so, the policy stops asking it every step.
            tried = lengths[0] or asked.get(id(rows[0]), 0)
            if tried:
                rows[0].speculator.policy.observe(tried, done.accepted[0], elapsed,
                                                  one_off=traced, fed=woken > 0)
            elif rows[0].plain_left:
                self._stretch_step(rows[0], started)
        broken: dict[int, BaseException] = {}
        for key, group in list(self._groups.items()):
            try:
                group.commit(rows, done.accepted, lengths)
            except Exception as exc:  # noqa: BLE001 - a plugin's failure ends its rows only
                self._groups.pop(key)
                broken.update((id(row), group.error("commit", exc))
                              for row in group.serves)
        finished = []
        for b, (row, kept) in enumerate(zip(rows, done.kept)):
            if id(row) in broken:
                continue
            if done.distrusted[b]:
                self._distrusted(row.speculator, done.distrusted[b])
            if lengths[b]:
                row.spec_stats.record(lengths[b], lengths[b], done.accepted[b])
                self._policy.learn(row.speculator.kind, lengths[b], done.accepted[b], row)
            elif row.spec_stats is not None:
                row.spec_stats.record(0, 0, 0)  # a plain step of a speculating request
                if asked.get(id(row)):  # its drafter found nothing: none of it was kept
                    self._policy.learn(row.speculator.kind, asked[id(row)], 0, row)
            logprobs = done.logprobs.get(b)
            if self._commit(row, kept, logprobs):
                finished.append(b)
        self._checkpoint(finished)
        self._end(finished)
        for row in [row for row in rows if id(row) in broken]:
            self._fail([row], broken[id(row)])

    def _join_drafters(self, joining: list[_Row]) -> dict[int, Any]:
        """Joining rows join their drafters' groups, each group's together (its drafter fed
        them now, or when they first draft: :class:`~foretell.spec.batch.DraftGroup`), in one
        prefill for all of them where the drafter batches it (a two-model drafter: one
        draft-model forward, not one per row). A row that cannot speculate decodes plainly.
        Returns the drafter states to store with each row's prompt (by ``id(row)``), where it
        has a link to the cache tier and its drafter was fed."""
        by_group: dict[tuple[int, bool], list[_Row]] = {}
        for row in joining:
            if row.speculator is not None:
                by_group.setdefault((id(row.speculator), row.solo), []).append(row)
        attachments: dict[int, Any] = {}
        # A row's drafter is fed at once only where its state is stored with the prompt and
        # the batch (or a lone row) drafts now; otherwise when the row first drafts.
        drafting = self._policy.drafting if self._rows or len(joining) > 1 \
            else self._alone_drafting
        for rows in by_group.values():
            speculator = rows[0].speculator
            try:
                group = self._group(speculator, rows[0].solo)
                joined = group.add(rows, [row.link for row in rows],
                                   [drafting and row.link is not None for row in rows])
            except Exception as exc:  # noqa: BLE001 - the rows decode plainly instead
                joined = [exc] * len(rows)
            for row, outcome in zip(rows, joined):
                if outcome is True:
                    if row.link is not None and row in group.members:
                        try:
                            attachments[id(row)] = group.attachment(row, row.link, row.state)
                        except Exception as exc:  # noqa: BLE001 - caching it is optional
                            log.warning("not caching the drafter's state: %s", exc)
                    continue
                _decodes_plainly(row, None if outcome is False else outcome)
        return attachments

    def _draft(self, rows: list[_Row], lengths: list[int]
               ) -> dict[int, tuple[mx.array, mx.array | None, int]]:
        """Every group's drafts, keyed by ``id(row)``. A drafter that fails ends its own
        rows with a :class:`~foretell.errors.DraftError` naming it; the others go on."""
        drafted: dict[int, tuple[mx.array, mx.array | None, int]] = {}
        for key, group in list(self._groups.items()):
            try:
                for b, part in group.draft(rows, lengths).items():
                    drafted[id(rows[b])] = part
                for row, exc in group.refused:  # rows its drafter was first fed now refused
                    _decodes_plainly(row, exc)
                group.refused = []
            except Exception as exc:  # noqa: BLE001 - a plugin's failure ends its rows only
                self._groups.pop(key)
                failing = [row for row in self._rows if row in group.serves]
                self._fail(failing, group.error("draft", exc))
                try:
                    group.rows.close()
                except Exception:  # noqa: BLE001 - it already failed; its error is reported
                    pass
        return drafted

    def _group_of(self, row: _Row) -> DraftGroup | None:
        if row.speculator is None:
            return None
        return self._groups.get((id(row.speculator), row.solo))

    def _distrusted(self, speculator: Speculator, flags: int) -> None:
        """Once per drafter and kind: what it returned was rejected (the output is safe)."""
        from foretell.spec.acceptance import distrust_message

        seen = self._warned.get(speculator.kind, 0)
        if flags & ~seen:
            self._warned[speculator.kind] = seen | flags
            logging.getLogger("foretell.scheduler").warning(
                "%s", distrust_message(speculator.label(), flags & ~seen,
                                       self.engine.model.vocab_size))

    def _plain_step(self) -> None:
        """A plain step for every row, pipelined as single-request decoding is: the next
        tokens are drawn on the device (``async_eval``) before this step's tokens are read
        and streamed, so the host's streaming overlaps the model's compute. A row finishing
        here already has its last token in the KV (:meth:`RequestState.held_tokens` says so)."""
        from foretell.sampling import draw_rows

        rows = self._rows
        started = time.perf_counter()
        ran, self._plain_rows = self._plain_rows, tuple(map(id, rows))
        # Timed only after a pipelined step over the same rows with no prefill between: the
        # first one after a synchronous step waits for nothing (the next step pays its
        # compute), and a prefill chunk or another row set would be paid here too.
        timed = ran == self._plain_rows and not self._prefilling
        tokens = self._tokens if self._tokens is not None else mx.array(
            [row.pending for row in rows], dtype=mx.int32)
        hidden, _ = self.engine.model.forward(tokens[:, None], layer_caches(self._batch))
        if self._keeps_hidden():
            self._hidden_steps().record(hidden, rows)
        logits = self.engine.model.logits(hidden[:, -1, :])
        drawn = draw_rows(logits, [
            (row.sampler, row.keys,
             len(row.state.prompt) + len(row.state.generated) + row.unread)
            for row in rows])
        mx.async_eval(drawn)
        self._close_finished()
        first = any(not row.unread and not row.state.generated for row in rows)
        values = tokens.tolist() if any(row.unread for row in rows) else None
        finished = []
        for b, row in enumerate(rows):
            if row.unread:
                if row.spec_stats is not None:
                    row.spec_stats.record(0, 0, 0)
                if self._commit(row, [values[b]]):
                    finished.append(b)
            row.unread = True
        self._tokens = drawn
        self._policy.observe(len(rows), 0, time.perf_counter() - started if timed else None)
        if len(rows) == 1 and rows[0].plain_left:
            self._stretch_step(rows[0], started)
        self._checkpoint(finished)
        self._end(finished)
        if first:
            # A row's first token streams as the step that drew it ends, not after the next
            # step's forward: time to first token. The next step waits for nothing, so it
            # times nothing (as after a synchronous step), nor does a stretch begun here.
            self._plain_rows = None
            self._settle()
            for row in self._rows:
                row.stretch_times = []

    def _settle(self) -> None:
        """Read and commit the tokens pipelined steps drew: every row's pending token is on
        the host after this."""
        if self._tokens is None:
            return
        values = self._tokens.tolist()
        self._close_finished()
        finished = []
        for b, row in enumerate(self._rows):
            if row.unread:
                row.unread = False
                if row.spec_stats is not None:
                    row.spec_stats.record(0, 0, 0)
                if self._commit(row, [values[b]]):
                    finished.append(b)
        self._tokens = None
        self._end(finished)

    def _commit(self, row: _Row, kept: list[int], logprobs: mx.array | None = None) -> bool:
        """Row ``row`` gained ``kept``: its sequence (its drafter hears them from there when
        it is next fed, :class:`~foretell.spec.batch.DraftGroup`), its stream. Returns
        whether the row is done."""
        row.state.generated.extend(kept)
        event = row.cut.feed(kept)
        if row.constraint is not None:
            row.constraint.accept(kept[0])
            if row.constraint.complete():
                row.cut.complete()
        if event is not None:
            if logprobs is not None:
                event = attrs.evolve(event, logprobs=(
                    _token_logprobs(logprobs, kept[0], row.logprobs),))
            row.handle._put(event)
        return row.cut.done

    def _checkpoint(self, finished: Sequence[int]) -> None:
        """Checkpoint the resumable rows that are due (``resume=True``), each with its
        own caches taken out of the batch for the moment: a speculative row whose drafter
        checkpoints itself at this round boundary, with the drafter's state; any other
        row as its step goes (:meth:`~foretell.cache.request.RequestCache.observe`)."""
        for b, row in enumerate(self._rows):
            request = row.request
            if not row.resume or request is None or b in finished:
                continue
            state = row.state
            if row.link is not None and row.link.checkpoints is not None:
                if row.unread or not row.round_checkpoint_due:
                    continue
                state.caches = [cache.extract(b) for cache in self._batch]
                try:
                    group = self._group_of(row)
                    attachment = group.attachment(row, row.link, state) \
                        if group is not None and row in group.members else None
                    request.checkpoint_round(state, state.generated[-1], attachment)
                finally:
                    state.caches = []
            elif request.observing(len(state.generated)):
                state.caches = [cache.extract(b) for cache in self._batch]
                try:
                    request.observe(state)
                finally:
                    state.caches = []

    def _progressed(self, row: _Row, tokens: int) -> None:
        """Tell ``prefill_progress`` of a chunk; one that raises fails its request only."""
        row.prefilled += tokens
        if row.progress is None:
            return
        try:
            row.progress(row.prefilled, row.prefill_total)
        except Exception as exc:  # noqa: BLE001 - the caller's callback fails its request
            self._fail([row], exc)

    def _replay(self, row: _Row) -> bool:  # a resumed row's restored tokens; done?
        event = row.cut.feed(list(row.state.generated))
        if event is not None:
            row.handle._put(event)
        return row.cut.done

    def _finish(self, b: int) -> None:
        row = self._rows[b]
        tail = row.cut.close()
        if tail is not None:
            row.handle._put(tail)
        state = row.state
        state.caches = [cache.extract(b) for cache in self._batch]
        group = self._group_of(row)
        if row.link is not None and group is not None and row in group.members:
            try:
                if state.held == len(state.prompt) + len(state.generated):
                    trim_all(state.caches, 1)  # the drafter's state lines up one token back
                row.link.final = group.attachment(row, row.link, state)
            except Exception as exc:  # noqa: BLE001 - caching the drafter never fails a row
                log.warning("not caching the drafter's state: %s", exc)
        stats = self.engine._stats(state, row.handle.submitted_at, row.started, row.cut.first_at)
        if row.spec_stats is not None:
            stats = attrs.evolve(stats, speculation=row.spec_stats.to_dict())
        if row.request is not None and self._tokens is not None:
            # These caches are views of the step in flight: storing them now would wait for
            # it, the device idle while the next step is built. They (and the drafter's state
            # stored with them) are computed next in line and stored once the next step is
            # dispatched; END follows the store, so a follow-up turn still finds it.
            final = row.link.final if row.link is not None else None
            held = [*state.caches, *([final] if final is not None else [])]
            mx.async_eval([cache.state for cache in held])
            self._stores.append((row, stats))
            return
        self._close_row(row, stats)

    def _close_finished(self) -> None:
        """Store the finished rows :meth:`_finish` left for after a step's dispatch."""
        if not self._stores:  # every plain step asks
            return
        stores, self._stores = self._stores, []
        for row, stats in stores:
            self._close_row(row, stats)

    def _close_row(self, row: _Row, stats: Any) -> None:
        state = row.state
        if row.request is not None:
            try:
                row.request.finish(state.held_tokens(), state.caches, completed=True)
            except Exception as exc:  # noqa: BLE001 - the cold tier never fails a request
                log.warning("not cached: %s", exc)
        state.caches = []
        row.handle._put(stats)
        row.handle._put(END)

    def _end(self, finished: list[int]) -> None:
        if finished:
            for b in finished:
                self._finish(b)
            self._remove(finished)
            if not self._rows:  # what they kept of the rows that ran goes with them
                self._rates_known = None
                if self._steps_hidden is not None:
                    self._steps_hidden.clear()

    def _keeps_hidden(self) -> bool:
        """Whether a drafter of the batch reads the target's hidden states."""
        return any(group.steps is not None for group in self._groups.values())

    def _hidden_steps(self) -> StepHidden:
        if self._steps_hidden is None:
            self._steps_hidden = StepHidden()
        return self._steps_hidden

    def _choose_lengths(self, rows: Sequence[_Row]) -> list[int]:
        """Each row's draft length this step: at most its drafter's, never past
        ``max_tokens``. A row running alone follows its speculator's length policy, as a
        request decoding by itself does; a batch follows the batch policy, unless every
        speculating row asked for a fixed length (``adaptive=False``)."""
        if not any(row.speculator is not None for row in rows):
            return [0] * len(rows)
        if len(rows) == 1 and self._alone(rows[0]):
            return [self._alone_length(rows[0])]
        rates, adaptive, top = self._row_rates(rows)

        def caps() -> list[int]:
            rolls_back = self._rolls_rows_back()  # once a step: it asks each layer
            return [self._cap(row, rolls_back) for row in rows]

        def left() -> list[int]:
            return [row.max_tokens - row.state.consumed - row.unread for row in rows]

        if not adaptive:
            return caps()
        # With no request waiting to take a finished row's place, the batch ends with its
        # slowest row: the policy weighs the drift drafting adds (batch_policy's docstring).
        draining = None if (self._waiting or self._prefilling or self._queued) else left
        dormant = sum(len(group.dormant) for group in self._groups.values())
        return self._policy.choose(caps, rates, top, draining, dormant)  # each asked if needed

    def _row_rates(self, rows: Sequence[_Row]) -> tuple[list[float | None], bool, int]:
        """Each row's acceptance estimate (None: it has no drafter), whether any row's
        length is adaptive, and the most any row drafts a round: worked out again only when
        the rows or what the batch policy learned changed, as a batch of idle drafters
        steps on learning nothing."""
        known = self._rates_known
        if known is None or known[0] != tuple(rows):
            self._policy.retain(rows)  # what rows that left taught goes with them
        key = (tuple(rows), self._policy.version)
        if known is None or known[:2] != key:
            rates, adaptive, top = [], False, 0
            for row in rows:
                speculator = row.speculator
                if speculator is None:
                    rates.append(None)
                    continue
                rates.append(self._policy.row_rate(row, speculator.kind))
                adaptive = adaptive or speculator.adaptive
                top = max(top, speculator.max_tokens)
            known = self._rates_known = (*key, rates, adaptive, top)
        return known[2], known[3], known[4]

    def _cap(self, row: _Row, rolls_back: bool | None = None) -> int:
        """The most row ``row`` may draft now (``rolls_back``: :meth:`_rolls_rows_back`,
        where the caller knows it)."""
        if row.speculator is None or not self._past_first(row) or not (
                self._rolls_rows_back() if rolls_back is None else rolls_back):
            return 0
        remaining = row.max_tokens - row.state.consumed - row.unread - 1
        return max(0, min(row.speculator.max_tokens, remaining))

    @staticmethod
    def _past_first(row: _Row) -> bool:
        """Whether the row may draft by the length policy: its first token came, by a plain
        step (time to first token: no draft to verify, no drafter to feed first), or it
        drafts a fixed length from the start."""
        return bool(row.state.generated) or row.unread or not row.speculator.adaptive

    def _rolls_rows_back(self) -> bool:
        # A batch whose rows cannot roll back apart (a model's own batch caches over
        # recurrent state or rings) decodes every row plainly: a rejected draft would stay.
        return all(getattr(c, "trims_rows", True) for c in self._batch)

    @staticmethod
    def _alone(row: _Row) -> bool:
        # Fixed lengths too: a fixed policy chooses its length, and a scripted one (the
        # warm-up's switch-backs) its script.
        return row.speculator is not None

    def _alone_length(self, row: _Row) -> int:
        """The length policy's choice for a row running alone: a plain stretch of the
        length it asks for once it says 0, then, having learned the stretch's typical step
        (:meth:`_stretch_step`), it is asked again."""
        if row.plain_left or not self._past_first(row):
            return 0
        policy = row.speculator.policy
        if row.stretch_times:
            # The stretch's last gap ends here, at the next round's start: its last step
            # waited for the compute of the one before, as each pipelined step does, so a
            # stretch of two steps yields one timing. Another request's prefill chunk, run
            # just before this, would be in it.
            times = [*row.stretch_times, time.perf_counter()]
            row.stretch_times = []
            gaps = sorted(b - a for a, b in zip(times[1:], times[2:]))
            if gaps and not self._prefilling:
                policy.observe(0, 0, gaps[len(gaps) // 2])
        k = policy.choose(self._cap(row))
        self._alone_drafting = k > 0
        if not k:
            row.plain_left = max(policy.stretch, 1)
        return k

    @staticmethod
    def _stretch_step(row: _Row, started: float) -> None:
        """One step of a lone row's plain stretch: its start, so that the gaps between the
        stretch's starts, from its second step's on (the first, which switched from
        drafting, waited for nothing), time its steps when the policy is next asked."""
        row.stretch_times.append(started)
        row.plain_left -= 1

    @staticmethod
    def _shares_prefill(row: _Row) -> bool:
        """Whether the row's chunk may go through a shared prefill forward: no layer of its
        keeps a window (the batch would hold the whole prompt where the row's own cache
        holds a window)."""
        return all(isinstance(cache, KVCache) and getattr(cache, "max_size", None) is None
                   for cache in row.state.caches)

    def _prefill_together(self, chunks: list[tuple[_Row, list[int]]]
                          ) -> tuple[list[_Row], list[Any]] | None:
        """Several rows' prompt chunks in one forward (the prompts padded to the longest,
        the padding trimmed off each row), each row then holding its own caches again, as
        a prefill of its own leaves them, and a row whose drafter reads hidden states its
        chunk's (the padding's left out); on CPUs a wide forward uses the matrix units
        better than several narrow ones. Returns the rows and the shared batch caches
        where every row's prompt is in (they join the batch as that batch, merged whole),
        else None."""
        rows = [row for row, _ in chunks]
        joins = None
        try:
            shared = batch_caches(self.engine.model, bits=self.engine.kv_bits,
                                  group_size=self.engine.kv_group_size)
            todo = [chunk for _, chunk in chunks]
            singles, hidden = prefill_rows(self.engine.model, todo,
                                           [row.state.caches for row in rows], shared=shared,
                                           chunk=max(len(t) for t in todo))
            kept = []
            for b, (row, chunk) in enumerate(chunks):
                row.state.caches = singles[b]
                if row.speculator is not None and row.speculator.wants_hidden:
                    row.feed_hidden.append(hidden[b : b + 1, : len(chunk)])
                    keep_recent_hidden(row.feed_hidden)
                    kept.append(row.feed_hidden[-1])
            # The hidden states only where a row keeps them: MLX then skips what nothing
            # reads (the last layer's output for these positions), as prefill() does.
            mx.eval([c.state for row in rows for c in row.state.caches], kept)
            if not any(row.todo for row in rows):
                joins = (rows, shared)
        except Exception as exc:  # noqa: BLE001 - these requests fail, not the others
            self._fail(rows, exc)
        release_buffers()
        return joins


def _decodes_plainly(row: _Row, exc: BaseException | None) -> None:
    """Row ``row``'s drafter cannot serve it (``exc``: what it raised; None: it cannot
    speculate, correct but not faster): the request decodes plainly from here on."""
    if exc is not None:
        log.warning("%s: %s; this request decodes plainly", row.speculator.label(), exc)
    row.speculator = row.spec_stats = None


def _token_logprobs(logprobs: mx.array, token: int, top: int) -> TokenLogprobs:
    """``token``'s entry of a ``[vocab]`` log-probability row, with the ``top`` best."""
    best = mx.argsort(-logprobs)[:top] if top else mx.array([], dtype=mx.int32)
    values = logprobs.astype(mx.float32)
    ids = best.tolist()
    return TokenLogprobs(token, float(values[token].item()),
                         tuple(zip(ids, values[best].tolist())) if ids else ())

