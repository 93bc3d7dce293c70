"""Crash-resumable generations: every N tokens the in-flight generation is checkpointed to
the SSD tier, and ``--resume`` continues it after a crash exactly as if it never stopped.

A checkpoint is an ordinary entry under namespace ``generation:<key>``, the key a digest of
the prompt and every setting that shapes the output, so it never seeds another prompt and a
changed setting never resumes an old run. Its caches hold the prompt and the first k
generated tokens; a meta-only ``generation`` layer (never trimmable) records the token
already chosen after them (``pending``) and the random stream's state, so a resume is
greedy-identical and draws on from the same stream. A new checkpoint replaces older ones
only once it is on disk. A speculative generation whose drafter checkpoints itself is
checkpointed at round boundaries (:meth:`Checkpointer.write_round`), the drafter's state as
an attachment layer and the verifier's stream in the mark.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from foretell.cache.attachment import DraftAttachment, split_attachment
from foretell.cache.codecs import clone_caches, restore_caches, snapshot_entry
from foretell.cache.tier import CHECKPOINT_PREFIX, CacheTier


@attrs.frozen(kw_only=True)
class GenerationMark:
    """Where a generation stood; stored as the entry's last layer (no tensors)."""

    prompt_tokens: int
    #: The token chosen after the entry's tokens, not yet fed to the model.
    pending: int
    #: The random stream after choosing ``pending`` (None when greedy).
    seed: int | None = None
    key: tuple[int, ...] | None = None

    #: Codecs compare offsets to entry lengths; a mark covers the whole entry.
    offset: int = 0


class GenerationCodec:
    """The meta-only layer of a generation checkpoint."""

    name = "generation"
    provider_id = "foretell.baseline/generation@1"

    def matches(self, cache: Any) -> bool:
        return type(cache) is GenerationMark

    def snapshot(self, mark: GenerationMark) -> tuple[dict, dict[str, Any]]:
        meta = attrs.asdict(mark)
        meta["key"] = list(mark.key) if mark.key is not None else None
        return {}, meta

    def load(self, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> GenerationMark:
        key = meta.get("key")
        return GenerationMark(prompt_tokens=int(meta["prompt_tokens"]), pending=int(meta["pending"]),
                              seed=meta.get("seed"), key=tuple(key) if key is not None else None,
                              offset=int(meta["offset"]))

    def clone(self, mark: GenerationMark) -> GenerationMark:
        return mark

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        return False  # a checkpoint serves its exact boundary only

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        return int(meta["offset"])


def checkpoint_namespace(prompt: Sequence[int], settings: Mapping[str, Any],
                         namespace: str = "") -> str:
    """The namespace of one generation's checkpoints: prompt + every output-shaping setting."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps({"v": 1, "namespace": namespace, "settings": settings},
                             sort_keys=True, default=str).encode())
    digest.update(json.dumps(list(prompt)).encode())
    return CHECKPOINT_PREFIX + digest.hexdigest()


@attrs.frozen
class Resumed:
    """A checkpoint read back: caches holding ``tokens`` (the prompt and the first generated
    tokens), and the mark saying what comes next."""

    caches: list[Any]
    tokens: tuple[int, ...]
    mark: GenerationMark
    #: The drafter's state at this checkpoint (speculative generations), or None.
    draft: DraftAttachment | None = None

    @property
    def generated(self) -> list[int]:
        """The generated tokens so far, ``pending`` included: what a resume replays."""
        return [*self.tokens[self.mark.prompt_tokens:], self.mark.pending]


class Checkpointer:
    """Takes one generation's checkpoints every ``every`` tokens, through the tier's spill
    queue (off the decode path)."""

    def __init__(self, tier: CacheTier, namespace: str, prompt_tokens: int, every: int):
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 token, got {every}")
        self.tier = tier
        self.namespace = namespace
        self.prompt_tokens = prompt_tokens
        self.every = every
        self._held: tuple[tuple[int, ...], Any, tuple[int, ...] | None] | None = None
        self._next = every

    def skip_to(self, generated: int) -> None:
        """A resumed generation has ``generated`` tokens already: the next point is later."""
        self._next = generated + self.every

    def observe(self, held_tokens: Sequence[int], caches: Sequence[Any], generated: int,
                keys: Any) -> None:
        """Called after each step with the tokens the caches hold and the random stream.

        When a checkpoint is due, the caches' state is captured now (zero-copy), and written
        once the next step has chosen the token that follows it (the ``pending`` token).
        """
        if self._held is not None:
            tokens, entry, key = self._held
            self._held = None
            if len(held_tokens) > len(tokens):
                pending = held_tokens[len(tokens)]
                mark = GenerationMark(prompt_tokens=self.prompt_tokens, pending=pending,
                                      seed=getattr(keys, "seed", None), key=key,
                                      offset=len(tokens))
                self.tier.persist(snapshot_entry(tokens, [*entry, mark], self.tier.codecs,
                                                 self.namespace))
        consistent = all(c.offset == len(held_tokens) for c in caches)
        if generated >= self._next and len(held_tokens) > self.prompt_tokens and consistent:
            self._next = generated + self.every
            tokens = tuple(held_tokens)
            clones = clone_caches(caches, self.tier.codecs)
            self._held = (tokens, clones, tuple(keys.state()) if keys is not None else None)

    def busy(self, generated: int) -> bool:
        """Whether :meth:`observe` after ``generated`` tokens would take or write one."""
        return self._held is not None or generated >= self._next

    def due(self, generated: int) -> bool:
        """Whether a round boundary after ``generated`` tokens should be checkpointed."""
        return generated >= self._next

    def write_round(self, held_tokens: Sequence[int], caches: Sequence[Any], pending: int,
                    generated: int, keys: Any, attachment: DraftAttachment | None) -> None:
        """Checkpoint a speculative round boundary now: the caches hold ``held_tokens``,
        ``pending`` (the target's last choice) is not in them yet, and ``keys`` is the
        verifier's random stream after choosing it."""
        self._next = generated + self.every
        tokens = tuple(held_tokens)
        mark = GenerationMark(prompt_tokens=self.prompt_tokens, pending=pending,
                              seed=getattr(keys, "seed", None),
                              key=tuple(keys.state()) if keys is not None else None,
                              offset=len(tokens))
        layers = [*caches, *([attachment] if attachment is not None else []), mark]
        self.tier.persist(snapshot_entry(tokens, layers, self.tier.codecs, self.namespace))

    def finish(self) -> None:
        """The generation completed: its checkpoints are no longer needed."""
        self.tier.discard(self.namespace)


def find_checkpoint(tier: CacheTier, namespace: str, prompt: Sequence[int]) -> Resumed | None:
    """The furthest readable checkpoint of this generation, or None."""
    prompt = tuple(prompt)
    candidates = [s for s in tier.checkpoints(namespace)
                  if len(s.tokens) > len(prompt) and s.tokens[: len(prompt)] == prompt]
    for stored in sorted(candidates, key=lambda s: len(s.tokens), reverse=True):
        entry = tier.read(stored)
        if entry is None:
            continue
        *caches, mark = restore_caches(entry, tier.codecs)
        caches, draft = split_attachment(caches)
        if isinstance(mark, GenerationMark) and mark.prompt_tokens == len(prompt):
            return Resumed(caches=caches, tokens=entry.tokens, mark=mark, draft=draft)
    return None
