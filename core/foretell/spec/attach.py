"""The link between a request's drafter and the cache tier (the scheduler holds one per
speculating row).

A drafter that names its artifact and captures and restores itself
(``CheckpointableProvider``, ``CheckpointableSource``, or rows' ``capture(row)``) gets its
state stored with the target's entries: :meth:`DraftLink.capture` after the prompt, at the
request's end and at resumable round boundaries; :meth:`DraftLink.restore` when the prefix
came from an entry
carrying the same identity's attachment at its exact boundary, so the drafter does not
prefill it. Captures happen only where the target's caches hold every token but the pending
one, so a restore lines up with the target's next forward as an uninterrupted request does.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from foretell.cache.attachment import DraftAttachment, attach, feed_hidden, unpack
from foretell.spec.contract import CheckpointableProvider, CheckpointableSource
from foretell.store.entry import files_digest

log = logging.getLogger("foretell.spec")


def files_fingerprint(paths: Sequence[str | Path]) -> str:
    """32 hex digits naming the contents of ``paths`` (draft weights, a head's file, a
    config): :func:`foretell.store.files_digest`, the digest a target's cache identity
    takes of its weights (safetensors sampled per tensor, other files whole), so a
    drafter's start-up reads a few KiB a tensor instead of every byte. It guards against
    serving one draft model's state for another, not against adversaries (the cache
    directory is trusted like the model directory)."""
    return files_digest(paths)


def resumed_keys(keys: Any, state: Any) -> Any:
    """A source's random stream after ``restore(state, ...)``: the stored stream when the
    core handed one back (a resumed generation), else ``keys`` (the fresh one ``open`` made)."""
    if keys is None or state.keys is None:
        return keys
    from foretell.sampling import RandomKeys

    return RandomKeys.restored(keys.seed, state.keys)


def draft_identity(speculator: Any) -> str | None:
    """``<kind>/<digest>`` of the draft artifact (kind + the provider's identity facts), or
    None when the provider names none (its state is then never attached)."""
    provider = speculator.provider
    if not isinstance(provider, CheckpointableProvider):
        return None
    from foretell.spec.verifier import _call

    facts = _call(speculator, "draft_identity", provider.draft_identity)
    text = json.dumps({"kind": speculator.kind, "identity": facts}, sort_keys=True, default=str)
    return f"{speculator.kind}/{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}"


def draft_settings(speculator: Any) -> dict[str, Any]:
    """Everything about the drafter that shapes a speculative run's draws (a resumable
    generation's checkpoints are keyed by it: another drafter never resumes them)."""
    config = getattr(speculator.provider, "config", None)
    options = attrs.asdict(config) if attrs.has(type(config)) else None
    return {"kind": speculator.kind, "identity": draft_identity(speculator), "options": options,
            "max_tokens": speculator.max_tokens, "adaptive": speculator.adaptive,
            "acceptance": speculator.acceptance}


def preferred_identity(speculator: Any) -> str | None:
    """The draft identity a cache lookup should prefer at an exact boundary, or None.

    Only for drafters that read the target's hidden states over the prompt (MTP): a cache
    hit does not recompute those, so without its own state such a drafter cannot speculate
    at all and the request decodes plainly; its exact boundary is then worth more than a
    longer prefix. Any other drafter can prefill itself, and takes the longest prefix."""
    return draft_identity(speculator) if speculator.wants_hidden else None


class DraftLink:
    """One speculative request's drafter state and the cache: what was found, what is
    captured. ``checkpoints`` is the request's cache when the generation is resumable."""

    def __init__(self, speculator: Any, codecs: Sequence[Any], found: DraftAttachment | None,
                 *, resumed: bool = False, checkpoints: Any = None):
        self.speculator = speculator
        self.codecs = list(codecs)
        self.identity = draft_identity(speculator)
        self.found = found if found is not None and found.identity == self.identity else None
        self.resumed = resumed
        #: Resumable generations are checkpointed at round boundaries (the drafter's state
        #: goes with them, :meth:`foretell.batch_step.BatchStep._checkpoint`); otherwise the
        #: request cache checkpoints as plain decoding does.
        self.checkpoints = checkpoints if self.identity is not None else None
        #: The state captured when the request ended, for the entry ``finish`` stores.
        self.final: DraftAttachment | None = None
        #: Tokens the source was restored with (0: it prefilled from nothing).
        self.restored_tokens = 0
        self._warned = False

    def _usable(self, source: Any) -> bool:
        if self.identity is None:
            return False
        if isinstance(source, CheckpointableSource):
            return True
        if not self._warned:
            self._warned = True
            log.warning("%s names a draft identity but its source has no capture/restore; "
                        "its state is not cached", self.speculator.label())
        return False

    # -- restoring ------------------------------------------------------------------------

    def restore(self, source: Any, sequence: Sequence[int], held: int
                ) -> tuple[list[int], mx.array | None] | None:
        """Rebuild ``source`` from the attachment found with the target's ``held`` tokens of
        ``sequence``; returns the feed it has not heard yet (tokens and, for hidden-state
        drafters, their hidden states), or None when there is nothing to restore from."""
        found = self.found
        if found is None or found.offset != held or not self._usable(source):
            return None
        known = held + len(found.ahead)
        if list(sequence[held:known]) != found.ahead or len(sequence) < known:
            return None  # the prompt goes on differently from what the drafter saw
        try:
            state = unpack(found, self.codecs, with_keys=self.resumed)
            source.restore(state, list(sequence[: found.seen]))
        except Exception as exc:  # the source is still fresh (restore assigns last)
            self._failed("restore", exc)
            return None
        self.restored_tokens = found.seen
        return list(sequence[found.seen : known]), feed_hidden(found)

    # -- capturing ------------------------------------------------------------------------

    def capture(self, source: Any, state: Any, feed_tokens: Sequence[int],
                hidden: mx.array | None) -> DraftAttachment | None:
        """The source's state as an attachment for the target's caches as they are now
        (they must hold all of the sequence but its last token). ``feed_tokens`` (with
        ``hidden``) are the newest tokens the source has not been fed yet."""
        sequence = state.prompt + state.generated
        held = state.held
        if not self._usable(source) or held != len(sequence) - 1 or held < 1:
            return None
        if any(c.offset != held for c in state.caches):
            return None
        try:
            captured = source.capture()
            if captured is None:
                return None
            return attach(captured, identity=self.identity, offset=held, ahead=sequence[held:],
                          seen=len(sequence) - len(feed_tokens),
                          feed_hidden=hidden if feed_tokens else None, codecs=self.codecs,
                          keys=captured.keys)
        except Exception as exc:
            self._failed("capture", exc)
            return None

    def _failed(self, what: str, exc: Exception) -> None:
        # Caching the drafter is an optimization: its failure never fails the request.
        if not self._warned:
            self._warned = True
            log.warning("%s failed in %s(): %s: %s; its state is not cached for this request",
                        self.speculator.label(), what, type(exc).__name__, exc)
