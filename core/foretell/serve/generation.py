"""From a parsed request to the batch scheduler and back, for every route alike.

:class:`Backend` holds what the routes share: the engine and its scheduler, the prompt
builders (chat template, tools), the context limit, the server's sampling defaults, the
grammars, the drafters requests may name and the metrics. A route turns its API's body into
a :class:`Job`; :meth:`Backend.start` submits it (a full queue is a 429 with Retry-After, a
request that can never fit a 400), and the route reads the handle's events either streaming
(:meth:`Backend.events`) or whole (:meth:`Backend.collect`). A client that goes away cancels
its row at once: the scheduler frees its KV at its next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from foretell.config import SamplingConfig
from foretell.errors import ChatTemplateError, ForetellError, GenerationError, QueueFull
from foretell.serve.errors import APIError, bad_request
from foretell.serve.fields import field, number, refuse_unknown
from foretell.serve.grammar import Grammars
from foretell.serve.metrics import Metrics
from foretell.serve.tools import TemplateSupport, Tool, render

if TYPE_CHECKING:
    from foretell.engine import Engine
    from foretell.scheduler import RequestHandle, Scheduler
    from foretell.stream import Event, Stats, TextEvent, TokenLogprobs

#: The extension field's name in a request body, and what it may hold.
EXTENSION = "foretell"
EXTENSION_FIELDS = ("draft", "top_k", "min_p", "repetition_penalty", "ignore_eos")


@attrs.frozen(kw_only=True)
class Job:
    """One generation as a route asks for it."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    #: An llguidance grammar every token must satisfy (:mod:`foretell.serve.grammar`).
    grammar: str | None = None
    #: The scheduler's ``speculate``: True (the server's drafter), False, or a Speculator.
    speculate: Any = True
    ignore_eos: bool = False


@attrs.define
class Reply:
    """A whole reply: its text, tokens, per-token logprobs and the final stats (None when
    the request was cancelled)."""

    text: str = ""
    tokens: list[int] = attrs.Factory(list)
    logprobs: list[TokenLogprobs] = attrs.Factory(list)
    stats: Stats | None = None


class ClientGone(Exception):
    """The client disconnected before its reply was complete."""


class Backend:
    """What every route shares (see the module docstring)."""

    def __init__(self, engine: Engine, scheduler: Scheduler, *, served: Sequence[str],
                 max_tokens: int, sampling: SamplingConfig | None = None,
                 model_stops: Sequence[str] = (), metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.served = list(served)
        self.default_max_tokens = max_tokens
        self.default_sampling = sampling or SamplingConfig()
        #: Stop strings the model declares (generation_config.json), on every request.
        self.model_stops = tuple(model_stops)
        self.metrics = metrics or Metrics()
        self.grammars = Grammars(engine)
        self.context = context_length(engine)
        tokenizer = engine.tokenizer
        self.support = TemplateSupport.probe(tokenizer) if tokenizer.has_chat_template else None
        self._drafters: dict[str, Any] = {}
        self._drafters_lock = threading.Lock()

    @property
    def model_id(self) -> str:
        return self.served[0]

    # -- prompts --------------------------------------------------------------------------

    def chat_ids(self, messages: Sequence[dict[str, Any]], tools: Sequence[Tool] = ()) -> list[int]:
        if self.support is None:
            raise bad_request(f"model '{self.model_id}' has no chat template; send plain text "
                              "to /v1/completions instead", param="messages")
        try:
            text = render(self.engine.tokenizer, self.support, messages, tools)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def text_ids(self, prompt: Any, param: str = "prompt") -> list[int]:
        """A completion prompt: text (no chat template) or token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.engine.encode_prompt(prompt, chat=False)
        elif isinstance(prompt, list) and all(type(i) is int for i in prompt):
            vocab = self.engine.model.vocab_size
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise bad_request(f"'{param}': token id {bad[0]} is outside the vocabulary "
                                  f"[0, {vocab})", param=param)
            ids = list(prompt)
        else:
            raise bad_request(f"'{param}' must be a string or an array of token ids (one "
                              "prompt per request)", param=param)
        if not ids:
            raise bad_request(f"'{param}' is empty: there is no token to start from", param=param)
        return ids

    def budget(self, ids: Sequence[int], requested: int | None, param: str) -> int:
        """``max_tokens`` for a prompt of ``ids``: as requested, or the server's default,
        within the model's context."""
        if requested is not None and requested < 1:
            raise bad_request(f"'{param}' must be at least 1, got {requested}", param=param)
        if self.context is None:
            return requested or self.default_max_tokens
        room = self.context - len(ids)
        if room < 1 or (requested is not None and requested > room):
            asked = f" plus {requested} to generate ({param})" if requested else ""
            raise bad_request(
                f"this model's context is {self.context} tokens; the prompt has {len(ids)}"
                f"{asked}: shorten the prompt or ask for fewer tokens",
                param="messages" if room < 1 else param, code="context_length_exceeded")
        return requested or min(self.default_max_tokens, room)

    # -- options --------------------------------------------------------------------------

    def sampling(self, **given: Any) -> SamplingConfig:
        """The server's sampling defaults with what the request set (``temp`` etc.)."""
        changes = {k: v for k, v in given.items() if v is not None}
        try:
            return attrs.evolve(self.default_sampling, **changes)
        except (ValueError, TypeError) as exc:
            raise bad_request(f"sampling: {exc}") from None

    def stops(self, requested: Sequence[str]) -> tuple[str, ...]:
        """A request's stop strings and the model's own."""
        return (*requested, *(s for s in self.model_stops if s not in requested))

    def extension(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The ``foretell`` field: this server's own options (``draft``, ...)."""
        value = field(body, EXTENSION, dict, default={})
        refuse_unknown(value, EXTENSION_FIELDS, EXTENSION)
        return {
            "draft": field(value, "draft", str, where=EXTENSION),
            "top_k": number(value, "top_k", lo=0, hi=2**31 - 1, integer=True, where=EXTENSION),
            "min_p": number(value, "min_p", lo=0, hi=1, where=EXTENSION),
            "repetition_penalty": number(value, "repetition_penalty", lo=1e-6, hi=1e6,
                                         where=EXTENSION),
            "ignore_eos": field(value, "ignore_eos", bool, where=EXTENSION, default=False),
        }

    async def speculate(self, draft: str | None) -> Any:
        """The scheduler's ``speculate`` for ``foretell.draft``: the server's drafter (unset),
        none (``"none"``), or a registered one by name (built on first use and kept)."""
        if draft is None:
            return True
        if draft == "none":
            return False
        current = self.engine.speculator
        if current is not None and current.kind == draft:
            return current
        from foretell.plugin.registry import Kind

        names = self.engine.registry.names(Kind.DRAFT) if self.engine.registry else []
        if draft not in names:
            raise bad_request(f"'foretell.draft': no drafter named {draft!r} (registered: "
                              f"{', '.join(names) or 'none'}; or 'none')", param="foretell.draft")
        return await asyncio.to_thread(self._drafter, draft)

    def _drafter(self, name: str) -> Any:
        from foretell.concurrency import mlx_work
        from foretell.spec import make_speculator
        from foretell.spec.warmup import warm_up

        with self._drafters_lock:
            if name not in self._drafters:
                try:
                    with mlx_work():
                        speculator = make_speculator(self.engine.registry, self.engine.target,
                                                     name)
                    warm_up(self.engine, speculator)
                except ForetellError as exc:
                    raise bad_request(f"'foretell.draft': {exc}", param="foretell.draft") from None
                self._drafters[name] = speculator
            return self._drafters[name]

    # -- running --------------------------------------------------------------------------

    async def start(self, job: Job) -> RequestHandle:
        if job.grammar is None and self.scheduler.submits_at_once:
            # On the loop: a hop to a thread costs two GIL hand-offs, each waiting up to a
            # switch interval while the worker runs Python (most of a GPU step).
            return self._submit(job)
        return await asyncio.to_thread(self._submit, job)  # a grammar compiles; MLX work

    def _submit(self, job: Job) -> RequestHandle:
        constraint = self.grammars.constraint(job.grammar) if job.grammar else None
        try:
            return self.scheduler.submit(
                job.ids, max_tokens=job.max_tokens, sampling=job.sampling, stop=job.stop,
                chat=False, ignore_eos=job.ignore_eos, logprobs=job.logprobs,
                constraint=constraint, speculate=job.speculate)
        except QueueFull as exc:
            wait = self.metrics.retry_after(self.scheduler.queue_depth)
            raise APIError(429, f"the server is at capacity ({exc})", code="queue_full",
                           headers={"Retry-After": str(wait)}) from None
        except GenerationError as exc:
            raise APIError(400, str(exc), code="request_too_large"
                           if "never fit" in str(exc) else None) from None

    async def batches(self, handle: RequestHandle) -> AsyncIterator[list[Event]]:
        """The handle's events as they come, in lists (:meth:`RequestHandle.batches`: a
        stream writes each out in one piece); closing early (the client went away) cancels
        the request."""
        done = False
        try:
            async for batch in handle.batches():
                for event in batch:
                    if event.type == "text":
                        self.metrics.tokens(len(event.tokens))
                    else:
                        self.metrics.finished(event)
                yield batch
            done = True
        except GenerationError as exc:
            done = True
            raise APIError(500, str(exc)) from exc
        finally:
            if not done:
                handle.cancel()
                self.metrics.cancelled()

    async def writes(self, handle: RequestHandle, reply: Reply,
                     chunks: Callable[[TextEvent], list[str]]) -> AsyncIterator[str]:
        """A streamed reply's writes: each batch of the handle's events (:meth:`batches`),
        every text event as ``chunks`` writes it (its SSE events) and the batch joined into
        one piece; the request's stats go into ``reply``."""
        async for batch in self.batches(handle):
            out: list[str] = []
            for event in batch:
                if event.type == "text":
                    out += chunks(event)
                else:
                    reply.stats = event
            if out:
                yield "".join(out)

    async def collect(self, handle: RequestHandle, receive: Any) -> Reply:
        """The whole reply; ``receive`` (the ASGI channel) is watched meanwhile, and a
        disconnect cancels the request (:class:`ClientGone`)."""

        async def gather() -> Reply:
            reply = Reply()
            texts = []
            async for batch in self.batches(handle):
                for event in batch:
                    if event.type == "text":
                        texts.append(event.text)
                        reply.tokens += event.tokens
                        reply.logprobs += event.logprobs
                    else:
                        reply.stats = event
            reply.text = "".join(texts)
            return reply

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            handle.cancel()
            work.cancel()
            raise ClientGone
        return work.result()


def context_length(engine: Engine) -> int | None:
    """The positions the model was trained for (``max_position_embeddings``), if it says."""
    if engine.path is None:
        return None
    from foretell.model import read_config

    try:
        value = read_config(engine.path).get("max_position_embeddings")
    except ForetellError:
        return None
    return value if isinstance(value, int) and value > 0 else None


def stop_matched(tokenizer: Any, reply_text: str, tokens: Sequence[int],
                 stops: Sequence[str]) -> str | None:
    """Which stop string ended a reply: the one found where the reply's text ends in the
    decoded tokens (the token that completed it is the reply's last)."""
    if not stops:
        return None
    full = tokenizer.decode(list(tokens))
    at = len(reply_text) if full.startswith(reply_text) else 0
    found = [(full.find(s, at), s) for s in stops if full.find(s, at) >= 0]
    return min(found)[1] if found else None
