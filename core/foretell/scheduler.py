"""Many requests at once: the scheduler steps every running request in one forward.

Callers on any thread :meth:`Scheduler.submit` a prompt and read the returned
:class:`RequestHandle` for the same events :meth:`foretell.Engine.generate` streams (text,
then one :class:`~foretell.stream.Stats`); one worker thread owns the model. Each iteration
it admits waiting requests while their KV fits the byte budget (prefix-cache lookup),
prefills one chunk of one admitted request (running rows keep streaming meanwhile), joins
finished prefills to the batch, runs one decode forward over every running row
(:mod:`foretell.model.batch`), samples each row with its own settings and random keys, and
finishes rows: persist to the cache tier, release their KV.

A row computes what the request would compute alone: the same prefill convention (the last
prompt token heads the first step), the same sampler and position keys per token.
"""

from __future__ import annotations

import atexit
import collections
import logging
import queue
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx

from foretell import request as request_module
from foretell.batch_step import BatchStep
from foretell.errors import ForetellError, GenerationError, QueueFull
from foretell.model.batch import BatchKVCache, SoloCache, batch_caches, batches, default_kv_budget
from foretell.platform import device
from foretell.request import Progress, RequestState, prefill
from foretell.sampling import RandomKeys, Sampler, TokenConstraint
from foretell.spec.batch_policy import BatchDraftPolicy
from foretell.spec.contract import keep_recent_hidden
from foretell.stream import END, RequestHandle, StopMatcher, StreamCut

if TYPE_CHECKING:
    from foretell.cache.request import RequestCache
    from foretell.config import SamplingConfig
    from foretell.engine import Engine, Prompt
    from foretell.spec import Speculator
    from foretell.spec.batch import DraftGroup



@attrs.define(eq=False)
class _Row:
    """A request inside the scheduler, from admission to its last event."""

    handle: RequestHandle
    ids: list[int]
    sampler: Sampler
    stops: StopMatcher
    eos: frozenset[int]
    max_tokens: int
    #: Tokens of KV the row may come to hold (prompt + max_tokens).
    need: int
    state: RequestState | None = None
    request: RequestCache | None = None
    cut: StreamCut | None = None
    keys: RandomKeys | None = None
    started: float = 0.0
    #: Prompt tokens still to prefill (all but the last, which heads the first step).
    todo: list[int] = attrs.Factory(list)
    #: How many alternatives each token's logprobs list (None: no logprobs).
    logprobs: int | None = None
    constraint: TokenConstraint | None = None
    #: The row's drafter's link to the cache tier (a :class:`~foretell.spec.attach.DraftLink`).
    link: Any = None
    #: The drafter this row speculates with (None: plain decoding) and, for a drafter
    #: reading them, the prompt's hidden states until the row joins (after that its
    #: :class:`~foretell.spec.batch.DraftGroup` reads what its drafter has not heard).
    speculator: Speculator | None = None
    feed_hidden: list[mx.array] = attrs.Factory(list)
    spec_stats: Any = None
    #: The row's pending token was drawn on the device by a pipelined step and is not yet in
    #: ``state.generated`` (the scheduler's ``_tokens`` holds it).
    unread: bool = False
    #: Running alone, the row follows its speculator's own length policy (the one a request
    #: decoding by itself follows): plain steps left in the stretch it asked for, and their
    #: start times (the stretch's typical step is what it learns of plain decoding).
    plain_left: int = 0
    stretch_times: list[float] = attrs.Factory(list)
    #: ``(done, total)`` after each prefill chunk of this row (on the worker thread).
    progress: Progress | None = None
    #: Checkpoint as it goes, and continue an interrupted identical request.
    resume: bool = False
    #: Runs alone through its own caches (:class:`~foretell.model.batch.SoloCache`).
    solo: bool = False
    prefill_total: int = 0  # prompt tokens it prefills in all, and how many it has
    prefilled: int = 0

    @property
    def pending(self) -> int:
        """The sequence's last token: fed at the next step, not yet in the KV."""
        return (self.state.generated or self.state.prompt)[-1]

    @property
    def pipelined(self) -> bool:
        """Whether the row's next plain step may be drawn before its last token is read:
        nothing it decides needs that token on the host (logprobs, a grammar, a repetition
        penalty's window do)."""
        return (self.logprobs is None and self.constraint is None and not self.sampler.window
                and not self.round_checkpoint_due)

    @property
    def round_checkpoint_due(self) -> bool:
        """A checkpoint of a drafter's state is due: taken where a pipelined step never is."""
        link = self.link
        return (link is not None and link.checkpoints is not None
                and link.checkpoints.wants_round_checkpoint(self.state))


log = logging.getLogger(__name__)
#: Seconds a worker with nothing to do waits for a submission before it ends.
IDLE_EXIT_S = 2.0
#: Prefill chunks one iteration may take while no row decodes (a burst of prompts at once).
BURST_CHUNKS = 4

#: Schedulers whose worker may run, stopped at exit: a worker still stepping as MLX is torn
#: down (a ``generate`` loop left with ``break``) aborted the process.
_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _stop_workers() -> None:
    for scheduler in list(_LIVE):
        scheduler.close(drain=False)


class Scheduler(BatchStep):
    """Continuous batching over one engine (see the module docstring).

    :param max_rows: the most requests decoding together.
    :param kv_budget_bytes: live KV the running rows may take (default
        :func:`default_kv_budget`); a request admitted only when its prompt plus
        ``max_tokens`` fit beside the running ones, refused outright when it never could.
    :param max_waiting: requests that may wait for admission; :class:`QueueFull` beyond.
    """

    def __init__(self, engine: Engine, *, max_rows: int = 32,
                 kv_budget_bytes: int | None = None, max_waiting: int = 1024) -> None:
        if max_rows < 1 or max_waiting < 0:
            raise GenerationError(f"max_rows must be >= 1 and max_waiting >= 0, got "
                                  f"{max_rows}, {max_waiting}")
        self.engine = engine
        self.max_rows = max_rows
        self.kv_budget_bytes = default_kv_budget() if kv_budget_bytes is None else kv_budget_bytes
        self.max_waiting = max_waiting
        self._inbox: queue.SimpleQueue[_Row | None] = queue.SimpleQueue()
        self._waiting: collections.deque[_Row] = collections.deque()
        self._prefilling: collections.deque[_Row] = collections.deque()
        self._rows: list[_Row] = []
        self._batch: list[Any] | None = None
        #: ``int32 [B]``: each running row's pending token, on the device, while a pipelined
        #: step drew some of them (rows marked ``unread``); None when all are on the host.
        self._tokens: mx.array | None = None
        self._stores: list[tuple[_Row, Any]] = []  # finished rows storing after the next dispatch
        #: Per speculator (by id: a warm-up's or a request's own beside the engine's).
        self._groups: dict[int, DraftGroup] = {}
        #: Drafters whose CUDA kernels this scheduler started compiling (by id).
        self._precompiled: set[int] = set()
        self._policy = BatchDraftPolicy()
        #: Per drafter kind, the distrust flags already reported (since the worker was idle).
        self._warned: dict[str, int] = {}
        self._lock = threading.Lock()
        self._queued = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        self._token_bytes: int | None = None
        #: No batch holds this model's caches (None: not known yet); its batch trims rows.
        self._solo: bool | None = None
        self._trims_rows = True

    # -- callers' side -----------------------------------------------------------------

    def submit(self, prompt: Prompt, *, max_tokens: int = 256,
               sampling: SamplingConfig | None = None, stop: Sequence[str] = (),
               chat: bool | None = None, ignore_eos: bool = False,
               logprobs: int | None = None,
               constraint: TokenConstraint | None = None,
               speculate: bool | Speculator = True,
               prefill_progress: Progress | None = None,
               resume: bool = False) -> RequestHandle:
        """Queue a request; its events stream from the returned handle. Options as for
        :meth:`foretell.Engine.generate`, and:

        :param logprobs: report each token's log-probability and this many alternatives
            (0-20) on its :class:`~foretell.stream.TextEvent`.
        :param constraint: a :class:`TokenConstraint` every token must satisfy.
        :param speculate: the engine's drafter (True), plain decoding (False) or this
            :class:`~foretell.spec.Speculator` (:meth:`speculator` builds one by name). A row
            speculates by itself, verified in the batch's one forward; rows reporting
            logprobs or under a constraint decode plainly.
        :param prefill_progress: called ``(tokens done, tokens total)`` after each prefill
            chunk of this request, on the scheduler's worker thread: keep it short, and
            make it safe to call from another thread than the submitter's.
        :param resume: checkpoint this request as it goes and, if an earlier identical
            request (same prompt and settings) was interrupted, continue it from its last
            checkpoint (needs a cache with an SSD tier).

        :raises GenerationError: the request is invalid, longer than the model's context,
            or its KV can never fit the budget.
        :raises QueueFull: ``max_waiting`` requests are already waiting.
        """
        if max_tokens < 1:
            raise GenerationError(f"max_tokens must be >= 1, got {max_tokens}")
        if logprobs is not None and not 0 <= logprobs <= 20:
            raise GenerationError(f"logprobs must be in 0..20, got {logprobs}")
        ids = self.engine.encode_prompt(prompt, chat=chat)
        if not ids:
            raise GenerationError("the prompt is empty: there is no token to start from")
        self.engine._check_fits(len(ids))
        if resume:
            self.engine._check_resumable()
        need = len(ids) + max_tokens
        self._check_fits(need)
        handle = RequestHandle(self._wake, len(ids))
        eos = frozenset() if ignore_eos else self.engine.tokenizer.eos_token_ids
        row = _Row(handle=handle, ids=ids, sampler=Sampler(sampling), stops=StopMatcher(stop),
                   eos=eos, max_tokens=max_tokens, need=need, logprobs=logprobs,
                   constraint=constraint, progress=prefill_progress, resume=resume)
        speculator = self.engine.speculator if speculate is True else (speculate or None)
        if speculator is not None and (logprobs is not None or constraint is not None or (
                not row.sampler.greedy and not speculator.sampled)):
            speculator = None
        row.speculator = speculator
        with self._lock:
            if self._closing:
                raise GenerationError("the scheduler is closed")
            # Submissions in transit and those the worker holds unadmitted both wait.
            waiting = self._queued + len(self._waiting)
            if waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (the bound); retry later")
            self._queued += 1
            self._start()
        self._inbox.put(row)
        return handle

    def close(self, *, drain: bool = True) -> None:
        """Stop the worker: after every submitted request finished (``drain``), or now,
        ending the running ones as cancelled."""
        with self._lock:
            self._closing = True
            thread = self._thread
        if not drain:
            for row in [*self._rows, *self._prefilling, *self._waiting]:
                row.handle._cancelled.set()
        self._inbox.put(None)
        if thread is not None:
            thread.join()

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet decoding."""
        return self._queued + len(self._waiting) + len(self._prefilling)

    @property
    def submits_at_once(self) -> bool:
        """Whether :meth:`submit` can't wait on MLX (the first measures a token's KV bytes)."""
        return self._token_bytes is not None

    @property
    def running(self) -> int:
        return len(self._rows)

    def live_kv_bytes(self) -> int:
        return sum(cache.nbytes for cache in self._batch or ())

    def reset_policy(self) -> None:
        """Forget what the batch draft policy learned (while no request runs: after a warm-up
        whose steps compiled, :mod:`foretell.batch_warmup`)."""
        self._policy = BatchDraftPolicy()

    def _wake(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="foretell-scheduler",
                                            daemon=True)
            _LIVE.add(self)
            self._thread.start()

    def _check_fits(self, need: int) -> None:
        alone = self._reserve_bytes(1, need)
        if alone > self.kv_budget_bytes:
            raise GenerationError(
                f"this request's KV can never fit: {need} tokens (prompt + max_tokens) take "
                f"{alone / 2**20:.1f} MiB, the scheduler's KV budget is "
                f"{self.kv_budget_bytes / 2**20:.1f} MiB")

    # -- the worker --------------------------------------------------------------------

    def _work(self) -> None:
        from foretell.concurrency import WiredMemory, mlx_work

        wired = WiredMemory()
        while True:
            idle = not (self._rows or self._prefilling or self._waiting)
            if idle:
                # A drafter's distrusted output is reported once per drafter while the
                # worker is busy: so once a request for requests one after another.
                self._warned.clear()
                if wired.held:
                    with mlx_work():
                        wired.release()
            if not self._take_new(block=idle):
                return
            with mlx_work(), self.engine.settings.active():
                wired.hold()
                try:
                    self._drop_cancelled()
                    self._admit()
                    if self._tokens is not None and any(row.todo for row in self._prefilling):
                        # What pipelined steps drew streams before a prefill chunk holds the
                        # worker (a new row's first token among it), not after.
                        self._settle()
                    self._prefill_one_chunk()
                    if self._rows:
                        self._step()
                except Exception as exc:  # noqa: BLE001 - the rows fail, the worker lives on
                    self._fail([*self._rows, *self._prefilling], exc)
                if not self._rows:
                    self._close_finished()  # no next step to store behind

    def _take_new(self, block: bool) -> bool:
        """Move submissions into the waiting queue; False when the worker should end: closed,
        or idle for :data:`IDLE_EXIT_S` (an unused engine holds no thread, nor one it)."""
        timed_out = False
        try:
            # Once closing, no submission may come to wake a blocked worker: never wait then.
            waits = block and not self._closing
            item = self._inbox.get(block=waits, timeout=IDLE_EXIT_S if waits else None)
        except queue.Empty:
            item, timed_out = None, waits
        while True:
            if item is not None:
                self._waiting.append(item)  # first: submit() counts it waiting throughout
                with self._lock:
                    self._queued -= 1
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            done = (self._closing or timed_out) and not (
                self._rows or self._prefilling or self._waiting or self._queued)
            if done:
                self._thread = None
        return not done

    def _drop_cancelled(self) -> None:
        for pool in (self._waiting, self._prefilling):
            for row in [r for r in pool if r.handle.cancelled]:
                pool.remove(row)
                row.handle._put(END)
        gone = [b for b, row in enumerate(self._rows) if row.handle.cancelled]
        if gone:
            for b in gone:
                self._rows[b].handle._put(END)
            self._remove(gone)

    def _token_bytes_now(self) -> int:
        """KV bytes one token takes in every layer (measured once, by one forward)."""
        if self._token_bytes is None:
            from foretell.concurrency import mlx_work

            with mlx_work(), self.engine.settings.active():
                caches = self.engine.make_caches()
                self.engine.model.forward(mx.array([[0]], dtype=mx.int32), caches)
                mx.eval([c.state for c in caches])
                self._token_bytes = sum(a.nbytes for c in caches for a in c.state)
        return self._token_bytes

    def _reserve_bytes(self, rows: int, width: int) -> int:
        step = 256
        return rows * (-(-width // step) * step) * self._token_bytes_now()

    def _admit(self) -> None:
        if self._solo is None:
            holds, self._trims_rows = batches(self.engine.model)
            self._solo = not holds
        while self._waiting and len(self._rows) + len(self._prefilling) < self.max_rows:
            row, running = self._waiting[0], [*self._rows, *self._prefilling]
            # By itself through its own caches: no batch holds it, or none can roll it back.
            row.solo = self._solo or (row.speculator is not None and not self._trims_rows)
            if any(r.solo for r in running) or (row.solo and running):
                return
            admitted = [*running, row]
            width = max(r.need for r in admitted)
            if self._reserve_bytes(len(admitted), width) > self.kv_budget_bytes:
                return  # waits until running rows finish
            self._waiting.popleft()
            try:
                self._open(row)
            except Exception as exc:  # noqa: BLE001 - this request fails, not the others
                self._fail([row], exc)
                continue
            self._prefilling.append(row)

    def _open(self, row: _Row) -> None:
        engine = self.engine
        row.started = time.perf_counter()
        if not (self._rows or self._prefilling):
            mx.reset_peak_memory()  # alone, its peak is its own, as a request's used to be
        cuda = device.cuda_backend()
        if cuda is not None:
            # Kernels compiling in workers since load (and this drafter's) land before any
            # forward: a batch meets row counts one request never does, and each kernel it
            # compiled itself stalled every row for half a minute.
            provider = row.speculator.provider if row.speculator is not None else None
            if provider is not None and id(provider) not in self._precompiled:
                self._precompiled.add(id(provider))  # once: it walks the drafter's modules
                cuda.kernels.precompile(provider)
            cuda.kernels.wait()
        kind = row.speculator.kind if row.speculator is not None else None
        row.request = engine._request_cache(row.speculator, row.resume, {
            "max_tokens": row.max_tokens, "sampling": attrs.asdict(row.sampler.config),
            "stop": list(row.stops.stops), "eos": sorted(row.eos)})
        row.state = engine._open_request(row.ids, row.request)
        if kind is not None and row.request is not None:
            row.link = row.request.draft_link(row.speculator)
        # A resumed request's caches hold all of its checkpoint but the pending token.
        row.todo = [] if row.state.generated else row.ids[row.state.cached : -1]
        row.prefill_total = len(row.todo)
        # A resumed request draws on with its checkpoint's seed (keys are per position).
        row.keys = row.state.keys if row.state.keys is not None else row.sampler.keys()
        row.state.keys = row.keys
        row.cut = StreamCut(row.state, engine.tokenizer, row.stops, row.eos, row.max_tokens)
        if row.speculator is not None:
            from foretell.spec import SpeculationStats

            row.spec_stats = SpeculationStats(drafter=row.speculator.kind)

    def _prefill_one_chunk(self) -> None:
        """Up to one chunk's worth of admitted prompts (several while no row decodes), oldest
        first (several short prompts arriving together all start this step, so the last of
        them does not wait a step per prompt ahead of it), in one forward where they can
        share one (:meth:`_prefill_together`); rows whose prompt is in join the batch."""
        chunk_max = request_module.PREFILL_CHUNK
        # While rows decode, one chunk's worth: they wait for it. With none running, prompts
        # that came together prefill together (up to BURST_CHUNKS chunks), so they join at
        # one length: rows of one length decode without a mask (docs/decisions.md).
        budget = chunk_max * (1 if self._rows else BURST_CHUNKS)
        chunks, longest = [], 0
        for row in list(self._prefilling):
            if budget <= 0:
                break
            if not row.todo:
                continue
            chunk = row.todo[: min(budget, chunk_max)]
            # A shared forward's attention scores (rows x longest^2) stay within one full
            # chunk's, as every prefill's did.
            if chunks and (len(chunks) + 1) * max(longest, len(chunk)) ** 2 > chunk_max**2:
                break
            row.todo = row.todo[len(chunk) :]
            budget -= len(chunk)
            longest = max(longest, len(chunk))
            chunks.append((row, chunk))
        together = [(row, chunk) for row, chunk in chunks if self._shares_prefill(row)]
        shared = None
        if len(together) > 1:
            shared = self._prefill_together(together)
        else:
            together = []
        for row, chunk in chunks:
            if (row, chunk) in together:
                continue
            hidden_kept = row.speculator is not None and row.speculator.wants_hidden
            try:
                hidden = prefill(self.engine.model, chunk, row.state.caches,
                                 keep_hidden=hidden_kept)
            except Exception as exc:  # noqa: BLE001 - this request fails, not the others
                self._fail([row], exc)
                continue
            if hidden is not None:
                row.feed_hidden.append(hidden)
                keep_recent_hidden(row.feed_hidden)
        for row, chunk in chunks:
            if row in self._prefilling:  # (a row whose prefill failed has left)
                self._progressed(row, len(chunk))
        joining = [row for row in self._prefilling if not row.todo]
        for row in joining:
            self._prefilling.remove(row)
        if joining:
            self._join(joining, shared)

    def _join(self, joining: list[_Row],
              shared: tuple[list[_Row], list[Any]] | None = None) -> None:
        """Rows whose prompts are in join the batch; ``shared``: rows of a shared prefill
        and its batch caches, merged in whole where all of them join
        (:meth:`_prefill_together`)."""
        try:
            if self._batch is None:
                self._batch = [SoloCache() for _ in joining[0].state.caches] if joining[0].solo \
                    else batch_caches(self.engine.model, bits=self.engine.kv_bits,
                                      group_size=self.engine.kv_group_size)
            merged = []
            if shared is not None and all(row in joining for row in shared[0]) and all(
                    isinstance(c, BatchKVCache) for c in (*self._batch, *shared[1])):
                merged = shared[0]
                joining = [row for row in joining if row not in merged] + merged
            alone = joining[: len(joining) - len(merged)]
            for layer, cache in enumerate(self._batch):
                if alone:
                    cache.append([row.state.caches[layer] for row in alone])
                if merged:
                    cache.merge(shared[1][layer])
        except Exception as exc:  # noqa: BLE001 - a half-joined batch cannot go on
            self._fail([*self._rows, *joining], exc)
            self._rows, self._batch, self._groups, self._tokens = [], None, {}, None
            return
        if self._tokens is not None:
            self._tokens = mx.concatenate([self._tokens, mx.array(
                [row.pending for row in joining], dtype=mx.int32)])
        attachments = self._join_drafters(joining)
        for row in joining:
            attachment = attachments.get(id(row))
            if row.link is not None and row.spec_stats is not None:
                row.spec_stats.draft_cached = row.link.restored_tokens
            if row.request is not None:
                row.request.after_prefill(row.state.held_tokens(), [
                    *row.state.caches, *([attachment] if attachment is not None else [])],
                    row.state.cached)
            row.state.caches = []  # the batch holds them now
            row.feed_hidden = []
        self._rows.extend(joining)
        # A resumed row streams what its checkpoint holds at once (it may end there).
        self._end([b for b, row in enumerate(self._rows)
                   if row in joining and row.state.resumed and self._replay(row)])

    def _group(self, speculator: Speculator, alone: bool = False) -> DraftGroup:
        group = self._groups.get((id(speculator), alone))
        if group is None:
            from foretell.spec.batch import DraftGroup

            # A row alone drafts through per-request sources: they roll back what rows can't.
            group = DraftGroup(speculator, self.engine.target, per_request=alone,
                               steps=self._hidden_steps())
            self._groups[(id(speculator), alone)] = group
        return group

    def _remove(self, indices: Sequence[int]) -> None:
        gone = {id(self._rows[b]) for b in indices}
        keep = [b for b, row in enumerate(self._rows) if id(row) not in gone]
        for key, group in list(self._groups.items()):
            group.leave(gone)
            if not group.serves and group.speculator is not self.engine.speculator:
                # A speculator no request uses now (a warm-up's copy, one a request brought):
                # its drafter's rows go with it; the engine's stay ready for the next request.
                self._groups.pop(key)
                try:
                    group.rows.close()
                except Exception:  # noqa: BLE001 - closing a drafter never fails a request
                    pass
        self._rows = [self._rows[b] for b in keep]
        if self._tokens is not None:
            unread = any(row.unread for row in self._rows)
            self._tokens = self._tokens[mx.array(keep, dtype=mx.int32)] if unread else None
        if self._batch is not None:
            if keep:
                for cache in self._batch:
                    cache.filter(keep)
            else:
                self._batch = None

    def _fail(self, rows: Sequence[_Row], exc: BaseException) -> None:
        if not isinstance(exc, ForetellError):  # foretell's own errors already say whose
            wrapped = GenerationError(f"generation failed: {type(exc).__name__}: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        running = [b for b, row in enumerate(self._rows) if row in rows]
        for row in rows:
            row.handle._put(exc)
            if row in self._prefilling:
                self._prefilling.remove(row)
        if running:
            try:
                self._remove(running)
            except Exception:  # noqa: BLE001 - the batch itself is broken: start it over
                for row in self._rows:
                    if row not in rows:
                        row.handle._put(exc)
                self._rows, self._batch, self._groups, self._tokens = [], None, {}, None
