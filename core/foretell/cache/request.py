"""What one request does with the cache tier, in the order the engine calls it:

1. ``open``: resume from a checkpoint (``resume=True``), else look up the longest usable
   prefix; caches come back as clones the request owns.
2. ``after_prefill``: store the prompt snapshot (a boundary the next turn can always use).
3. ``observe`` (plain) or ``checkpoint_round`` (a drafter that checkpoints itself): with
   ``resume``, checkpoint every N tokens.
4. ``finish``: store prompt + generation, drop the request's checkpoints, refill the
   layout's restore reserve if this request's restore used it.

A drafter's state travels as an attachment layer (:mod:`foretell.cache.attachment`),
handed to the verifier by :meth:`RequestCache.draft_link`. Caches no codec handles are not
stored: the cold tier never takes serving down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from foretell.cache.attachment import DraftAttachment, split_attachment
from foretell.cache.checkpoint import Checkpointer, checkpoint_namespace, find_checkpoint
from foretell.cache.tier import CacheTier
from foretell.errors import CodecError
from foretell.sampling import RandomKeys

log = logging.getLogger("foretell.cache")


class RequestCache:
    """One request's use of a :class:`CacheTier` (see the module doc for the order)."""

    def __init__(self, tier: CacheTier, namespace: str, *, resume: bool = False,
                 settings: Mapping[str, Any] | None = None, prefer: str | None = None):
        self.tier = tier
        self.namespace = namespace
        #: A drafter identity whose exact-boundary state beats a longer trimmed prefix.
        self.prefer = prefer
        self.resume = resume and tier.ssd is not None
        self.settings = dict(settings or {})
        self._checkpointer: Checkpointer | None = None
        self._warned = False
        #: The drafter's state stored with the entry ``open`` found (None: none, stale, or
        #: the entry served a shorter prefix than it holds).
        self.draft: DraftAttachment | None = None
        self._resumed = False
        self._link: Any = None

    def open(self, prompt: list[int], make_caches: Callable[[], list[Any]]
             ) -> tuple[list[Any], int, str | None, list[int], Any]:
        """``(caches, cached prompt tokens, tier, generated tokens to replay, random
        stream)``; the last two only when resuming a checkpoint."""
        if self.resume:
            namespace = checkpoint_namespace(prompt, self.settings, self.namespace)
            self._checkpointer = Checkpointer(self.tier, namespace, len(prompt),
                                              self.tier.checkpoint_every)
            resumed = find_checkpoint(self.tier, namespace, prompt)
            if resumed is not None:
                self._checkpointer.skip_to(len(resumed.generated))
                self.draft, self._resumed = resumed.draft, True
                keys = None
                if resumed.mark.key is not None:
                    keys = RandomKeys.restored(resumed.mark.seed, resumed.mark.key)
                return resumed.caches, len(prompt), "checkpoint", resumed.generated, keys
        reuse = self.tier.lookup(prompt, self.namespace, self.prefer)
        if reuse.caches is None:
            return make_caches(), 0, None, [], None
        caches, self.draft = split_attachment(reuse.caches)
        return caches, reuse.tokens, reuse.tier, [], None

    def draft_link(self, speculator: Any) -> Any:
        """The verifier's link to this request's drafter state (see :mod:`foretell.spec.attach`)."""
        from foretell.spec.attach import DraftLink

        self._link = DraftLink(speculator, self.tier.codecs, self.draft, resumed=self._resumed,
                               checkpoints=self if self._checkpointer is not None else None)
        return self._link

    def checkpoint_round(self, state: Any, pending: int,
                         attachment: DraftAttachment | None) -> None:
        """A speculative round boundary: checkpoint it when one is due (resumable only)."""
        if self._checkpointer is None or not self._checkpointer.due(len(state.generated)):
            return
        try:
            self._checkpointer.write_round(state.held_tokens(), state.caches, pending,
                                           len(state.generated), state.keys, attachment)
        except CodecError as exc:
            self._skip(exc)

    def wants_round_checkpoint(self, state: Any) -> bool:
        return self._checkpointer is not None and self._checkpointer.due(len(state.generated))

    def after_prefill(self, held_tokens: list[int], caches: list[Any], cached: int) -> None:
        if len(held_tokens) > cached:  # nothing new was computed: the tier has it already
            self._store(held_tokens, caches)

    def observing(self, generated: int) -> bool:
        """Whether :meth:`observe` after a step that left ``generated`` tokens would do
        anything (a checkpoint is due, or one taken waits for its pending token): the
        scheduler takes a row's caches out of the batch only then."""
        return self._checkpointer is not None and self._checkpointer.busy(generated)

    def observe(self, state: Any) -> None:
        """After a step of a resumable request (``state.caches`` its own caches)."""
        try:
            self._checkpointer.observe(state.held_tokens(), state.caches,
                                       len(state.generated), state.keys)
        except CodecError as exc:
            self._skip(exc)

    def finish(self, held_tokens: list[int], caches: list[Any], completed: bool) -> None:
        final = self._link.final if self._link is not None else None
        if final is not None and final.offset == len(held_tokens):
            caches = [*caches, final]
        self._store(held_tokens, caches)
        if completed and self._checkpointer is not None:
            self._checkpointer.finish()
        # After the last token: a refill here delays no first token (this request's came
        # before it, the next request's lookup comes after).
        self.tier.replenish()

    def _store(self, tokens: list[int], caches: list[Any]) -> None:
        if any(c.offset != len(tokens) for c in caches):
            # A step source left tokens in the caches that the sequence does not name (an
            # unverified draft in flight): storing them under these tokens would be a lie.
            self._skip(f"the caches hold {caches[0].offset} tokens, the sequence {len(tokens)}")
            return
        try:
            self.tier.store(tokens, caches, self.namespace)
        except CodecError as exc:
            self._skip(exc)

    def _skip(self, exc: Exception | str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("not caching this request: %s", exc)
