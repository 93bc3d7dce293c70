"""The draft-source contract: what a draft provider plugin implements for the verifier.

A *provider* (``foretell_register_draft_providers``) lives as long as the process:
``prepare(target)`` checks the pairing (raising :class:`PairingError` before it allocates
anything) and loads weights, once per target; ``open(target, sampler)`` returns a
per-request :class:`DraftSource`. The verifier talks to a source in rounds: ``prefill(feed)``,
then ``draft(feed, n)`` for up to ``n`` proposals and ``commit(accepted)``. Every token of
the sequence arrives through a feed exactly once, the target's corrections included, so a
source never guesses the sequence. Shapes are ``[B, ...]`` (B = 1 today). A source may
checkpoint itself (:class:`CheckpointableSource`, its provider naming the artifact:
:class:`CheckpointableProvider`) so the cache tier stores its state with the target's entry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import mlx.core as mx

from foretell.errors import DraftError, PairingError  # noqa: F401 (defined there, raised here)

if TYPE_CHECKING:
    from foretell.model import Model
    from foretell.plugin.registry import Registry
    from foretell.sampling import Sampler
    from foretell.tokenizer import Tokenizer

#: Capability ports a source may require of its target (``DraftProvider.requires``). Every
#: :class:`~foretell.model.Model` offers ``embed``, ``logits`` and this one (its ``forward``
#: returns hidden states); other ports, such as :data:`~foretell.model.PORT_MTP`, are listed
#: in the model's ``capabilities``.
PORT_HIDDEN = "hidden"  # the target's final-normed hidden states arrive in every Feed

#: A built-in source fed more than this many new positions at once (drafting was off for a
#: while) starts its state over from the sequence's last this-many instead of catching up on
#: all of them: a catch-up grows with the stretch, and its lengths rarely repeat (what it
#: cost: docs/decisions.md). Its drafts then see less context; the output stays exact.
CATCH_UP_MAX = 32


def keep_recent_hidden(parts: list[mx.array]) -> None:
    """Trim ``parts`` (``[1, m, H]`` hidden states gathered for a hidden-state drafter while
    it is not drafting, oldest first) to what it will read: the newest :data:`CATCH_UP_MAX`
    positions' (a drafter further behind starts over from those, :class:`Feed`), and at most
    the rest of the oldest part kept."""
    newer = sum(h.shape[1] for h in parts) - parts[0].shape[1] if parts else 0
    while newer >= CATCH_UP_MAX:
        parts.pop(0)
        newer -= parts[0].shape[1]


@attrs.frozen(kw_only=True)
class Target:
    """What a provider learns about the model it drafts for."""

    model: Model
    tokenizer: Tokenizer
    #: The model directory (a drafter may read files beside the weights, e.g. an MTP head).
    path: Any = None
    registry: Registry | None = None

    @property
    def name(self) -> str:
        return str(self.path) if self.path is not None else self.model.model_type


@attrs.frozen
class Feed:
    """Tokens the sequence gained since the source last heard, and what the target saw.

    ``tokens`` are host ints. ``hidden`` is given only to sources that require
    :data:`PORT_HIDDEN`: the target's final-normed hidden states ``[B, m, H]`` for the
    newest positions the target has consumed, aligned with the end of ``tokens``
    (``hidden[:, -1]`` is the state that predicted ``tokens[-1]``, and so on back). The
    target consumes every token but the sequence's last, so the prompt's feed has one state
    fewer than tokens and a later feed as many, except that a feed of more than
    :data:`CATCH_UP_MAX` tokens (drafting was off) carries the states of its newest
    ``CATCH_UP_MAX`` tokens and at most a few more: holding every plain step's state cost
    decoding speed (docs/decisions.md).

    ``position`` (with ``draft``; None with ``prefill``) is the index in the sequence that
    the first token drafted for this feed would take. :class:`~foretell.spec.Drafting`
    given it draws a seeded request's drafts with the verifier's noise for those positions,
    so they agree with the target as often as any drafter can that does not see ``p``
    (docs/speculation.md).
    """

    tokens: list[int]
    hidden: mx.array | None = None
    position: int | None = None


@attrs.frozen
class Draft:
    """Proposed tokens ``[B, n]`` (n may be 0; an integer dtype) and, for sampled drafting,
    the distributions ``q`` ``[B, n, V]`` (a floating dtype, V the target's vocabulary) they
    were drawn from. ``q = None`` means each token was chosen deterministically (its
    distribution is the point mass on it), as prompt lookup does.

    The verifier never trusts either: a draft of another shape or type ends the request with
    a :class:`DraftError` naming the plugin (:func:`checked_draft`); an id outside the
    vocabulary, or a ``q`` row that is no distribution (:func:`usable_distributions`), is
    rejected at that position and the target draws the token there itself."""

    tokens: mx.array
    q: mx.array | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[-1]

    @classmethod
    def of(cls, tokens: Sequence[int]) -> Draft:
        return cls(mx.array([list(tokens)], dtype=mx.int32).reshape(1, len(tokens)))


#: How far a draft distribution's total may stray from 1 before the verifier takes it for
#: no distribution (a float32 softmax strays ~1e-6, a bfloat16 one a few 1e-3).
Q_SUM_TOLERANCE = 1e-2


def checked_draft(draft: Any, asked: int, vocab: int, label: str) -> Draft:
    """``draft`` if the verifier can judge it, else a :class:`DraftError` naming ``label``
    (the provider and its plugin). Only shapes and dtypes are checked: host-side metadata,
    read without waiting for the device; the values are judged on the device with the round
    (ids against the vocabulary, ``q`` by :func:`usable_distributions`)."""
    def refuse(what: str) -> DraftError:
        return DraftError(f"{label}: draft() returned {what}; a source returns "
                          "foretell.spec.Draft(tokens [1, n] integer mx.array, q None or "
                          f"[1, n, {vocab}] floating mx.array) with n <= {asked}")

    if not isinstance(draft, Draft):
        return_type = "None" if draft is None else f"a {type(draft).__name__}"
        raise refuse(return_type)
    tokens, q = draft.tokens, draft.q
    if not isinstance(tokens, mx.array):
        raise refuse(f"tokens of type {type(tokens).__name__}")
    if tokens.ndim != 2 or tokens.shape[0] != 1 or not mx.issubdtype(tokens.dtype, mx.integer):
        raise refuse(f"tokens {tokens.dtype} of shape {list(tokens.shape)}")
    n = tokens.shape[1]
    if n > asked:
        raise DraftError(f"{label} proposed {n} tokens; asked for {asked}")
    if q is None:
        return draft
    if not isinstance(q, mx.array):
        raise refuse(f"q of type {type(q).__name__}")
    if q.shape != (1, n, vocab) or not mx.issubdtype(q.dtype, mx.floating):
        raise refuse(f"q {q.dtype} of shape {list(q.shape)} for {n} tokens")
    return draft


def usable_distributions(q: mx.array) -> mx.array:
    """``[..., V]`` rows to ``[...]`` booleans: True where the row is a distribution (every
    entry finite and >= 0, the total within :data:`Q_SUM_TOLERANCE` of 1). On the device,
    no host sync: NaN fails both tests."""
    total = mx.sum(q, axis=-1)
    return mx.logical_and(mx.min(q, axis=-1) >= 0, mx.abs(total - 1) <= Q_SUM_TOLERANCE)


@runtime_checkable
class DraftSource(Protocol):
    """One request's drafting state."""

    def prefill(self, feed: Feed) -> None:
        """The prompt, before the first round (``feed.tokens`` is the whole prompt)."""

    def draft(self, feed: Feed, n: int) -> Draft:
        """Take in ``feed`` and propose up to ``n`` tokens continuing the sequence. The
        returned length is authoritative; 0 makes the round a plain decoding step."""

    def commit(self, accepted: int) -> None:
        """The target kept the first ``accepted`` proposals of the last draft; roll back the
        rest of any state they built (they arrive again in the next feed, with the target's
        own next token)."""

    def close(self) -> None:
        """The request ended; release per-request state."""


@attrs.frozen(kw_only=True)
class DraftState:
    """A source's whole state, as :meth:`CheckpointableSource.capture` returns it.

    ``caches`` are the source's own KV caches (any kind a cache codec handles: the tier
    stores them through the same codecs as the target's); ``tensors`` other arrays (e.g. a
    hidden state, an index as int32); ``meta`` small JSON-able facts. ``keys`` is the
    source's random stream (:meth:`~foretell.sampling.RandomKeys.state`, None when greedy):
    restore receives it only when the same generation resumes, so another request keeps
    the fresh stream ``open`` gave it.
    """

    caches: Sequence[Any] = ()
    tensors: Mapping[str, mx.array] = attrs.Factory(dict)
    meta: Mapping[str, Any] = attrs.Factory(dict)
    keys: list[int] | None = None


@runtime_checkable
class CheckpointableSource(DraftSource, Protocol):
    """A source whose state the cache tier may store with the target's entry."""

    def capture(self) -> DraftState | None:
        """Your state after every token fed so far. Called only between rounds (after
        ``commit``, before the next ``draft``) or right after ``prefill``; never mutate
        state because of it (what it returns may share your arrays: MLX arrays are values).
        None: nothing can be captured now (the entry is then stored without it)."""

    def restore(self, state: DraftState, tokens: Sequence[int]) -> None:
        """On a freshly opened source, instead of prefilling: become the source that
        captured ``state`` after being fed exactly ``tokens``. ``prefill`` follows with
        the prompt tokens past ``tokens`` (possibly none), their hidden states one per
        token as in a later feed; or, when a generation resumes, the next ``draft``'s feed
        carries what the sequence gained. Check before you change anything and raise if the
        state does not fit: the core then warns and prefills this source as if nothing had
        been cached (a failing capture likewise only leaves the entry without it)."""


@runtime_checkable
class CheckpointableProvider(Protocol):
    """A provider whose sources checkpoint themselves names what its state depends on."""

    def draft_identity(self) -> Mapping[str, Any]:
        """JSON-able facts that change a source's state: the draft weights' fingerprint,
        state-changing options (e.g. n-gram sizes), a version of the stored form. With the
        draft kind, it keys every attachment: another identity never restores it."""


@runtime_checkable
class DraftProvider(Protocol):
    """A drafter, for the life of the process."""

    #: Ports required of the target (e.g. ``{PORT_HIDDEN, PORT_MTP}``).
    requires: frozenset[str]
    # Optional: ``draft_tokens: int``, the most tokens a round drafts when the caller names
    # no length (``--num-draft-tokens``, ``[draft] num_tokens``, the model's
    # speculation.json); :func:`preferred_tokens` reads it. Optional: ``draft_cost() ->
    # float | None``, a drafted token's cost in target decode steps, read after ``prepare``
    # (:mod:`foretell.spec.cost_prior`).

    def prepare(self, target: Target) -> None:
        """Check the pairing and load draft weights; called once per target."""

    def open(self, target: Target, sampler: Sampler) -> DraftSource:
        """A source for one request, drafting with ``sampler``'s settings."""


def preferred_tokens(provider: Any, label: str) -> int:
    """The most tokens a round drafts when nobody says: the provider's ``draft_tokens``
    (prompt lookup drafts long copies cheaply, an MTP head keeps agreeing deep into its
    chain), else :data:`foretell.config.DEFAULT_DRAFT_TOKENS`.

    :raises DraftError: ``draft_tokens`` is not an integer in 1..MAX_DRAFT_TOKENS (``label``
        names the provider)."""
    from foretell.config import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS

    value = getattr(provider, "draft_tokens", None)
    if value is None:
        return DEFAULT_DRAFT_TOKENS
    if not valid_draft_tokens(value):
        raise DraftError(f"{label}: draft_tokens must be an integer in 1..{MAX_DRAFT_TOKENS}, "
                         f"got {value!r}")
    return value


def valid_draft_tokens(value: Any) -> bool:
    """Whether ``value`` may be the most tokens a round drafts (an int, not a bool)."""
    from foretell.config import MAX_DRAFT_TOKENS

    return type(value) is int and 1 <= value <= MAX_DRAFT_TOKENS


def missing_ports(provider: Any, target: Target) -> frozenset[str]:
    """Ports ``provider`` requires that ``target`` does not offer."""
    offered = frozenset(target.model.capabilities) | {PORT_HIDDEN}
    return frozenset(getattr(provider, "requires", frozenset())) - offered
