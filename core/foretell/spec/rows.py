"""Plugin API 2's draft contract: a drafter works on rows, one per running request.

A provider (process lifetime, owns the draft weights) opens a :class:`DraftRows` for a
target. Between rounds rows join (:meth:`DraftRows.append`, each with its prompt or a state
to restore) and leave (:meth:`DraftRows.filter`); each round :meth:`DraftRows.draft` takes
every row's :class:`~foretell.spec.Feed` (what its sequence gained since the row last heard,
the target's corrections included) and the most tokens it may propose, and returns a
:class:`RowDraft`: tokens ``[B, n_max]`` with per-row lengths (authoritative, 0 allowed) and,
for sampled drafting, the distributions ``q`` they were drawn from. :meth:`DraftRows.commit`
says how many of each row's proposals the target kept. One request alone is a group of one
row: the same code path.

The verifier trusts nothing a drafter returns: ids outside the vocabulary, lengths over
what was asked and ``q`` that is no distribution are rejections there, never output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import mlx.core as mx

if TYPE_CHECKING:
    from foretell.sampling import RandomKeys, Sampler
    from foretell.spec.contract import DraftState, Feed, Target


@attrs.frozen(kw_only=True)
class RowStart:
    """A request joining a drafter's rows.

    ``feed`` is its sequence so far (``feed.tokens``: the prompt, or prompt and generated
    tokens when a generation resumes or, for a provider that reads no hidden states, when
    the row first drafts: rows are appended then, not as they join the batch, unless their
    state is to be stored with the prompt) with the target's hidden states when the provider
    requires :data:`~foretell.spec.PORT_HIDDEN` (one state fewer than tokens: the last token
    is pending). ``sampler`` is the request's sampling settings; ``keys`` a random stream of
    the row's own for drafting (never the verifier's: sharing draws would bias the output).
    ``state``, when given, is what :meth:`DraftRows.capture` returned for an earlier row that
    had been fed exactly ``state_tokens`` (a cache hit, a resume): restore it instead of
    prefilling those tokens, then take in the rest of ``feed.tokens``; raise if it does not
    fit, and the core appends the row again without it.
    """

    feed: Feed
    sampler: Sampler
    keys: RandomKeys | None = None
    state: DraftState | None = None
    state_tokens: Sequence[int] = ()


@attrs.frozen
class RowDraft:
    """One round's proposals for every row.

    ``tokens``: ``int32 [B, n_max]``; row ``b``'s proposals are ``tokens[b, :lengths[b]]``
    (the rest is padding). ``q``: ``[B, n_max, V]``, the distributions row ``b``'s tokens were
    drawn from, or None when every token was chosen deterministically (a point mass, as
    prompt lookup and greedy drafting choose)."""

    tokens: mx.array
    lengths: tuple[int, ...]
    q: mx.array | None = None

    @classmethod
    def of(cls, rows: Sequence[Sequence[int]]) -> RowDraft:
        """Host-side proposals, one list per row (padded with 0)."""
        width = max((len(r) for r in rows), default=0)
        padded = [list(r) + [0] * (width - len(r)) for r in rows]
        tokens = mx.array(padded, dtype=mx.int32).reshape(len(rows), width)
        return cls(tokens, tuple(len(r) for r in rows))


@runtime_checkable
class DraftRows(Protocol):
    """A drafter's state for the rows of one batch (see the module docstring). Row ``b`` is
    the ``b``-th row appended and not filtered out, in order."""

    def append(self, rows: Sequence[RowStart]) -> None:
        """New rows at the end (prefill each, or restore its state): the core hands over
        the rows joining together in one call, so a drafter may prefill them in one
        forward. All of them join or, raising, none (the core then appends them one by
        one, to find the row that failed)."""

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (indices into the current rows, in their new order)."""

    def draft(self, feeds: Sequence[Feed], lengths: Sequence[int]) -> RowDraft:
        """Take in each row's feed and propose up to ``lengths[b]`` tokens for row ``b``
        (0: that row does not speculate this round, but its feed must still be taken)."""

    def commit(self, accepted: Sequence[int]) -> None:
        """Row ``b`` kept its first ``accepted[b]`` proposals: roll the rest back (they come
        again in the next feed, with the target's own next token)."""

    def capture(self, row: int) -> DraftState | None:
        """Row ``row``'s whole state, between rounds (after ``commit``) or right after its
        ``append``; None when nothing can be captured now. Never mutates the rows."""

    def close(self) -> None:
        """Release every row."""


@runtime_checkable
class RowsProvider(Protocol):
    """A drafter for plugin API 2, for the life of the process."""

    #: Ports required of the target (e.g. ``{PORT_HIDDEN, PORT_MTP}``).
    requires: frozenset[str]

    def prepare(self, target: Target) -> None:
        """Check the pairing (raise :class:`~foretell.errors.PairingError` before allocating)
        and load draft weights; called once per target."""

    def open_rows(self, target: Target) -> DraftRows:
        """An empty row group drafting for ``target``."""


def checked_lengths(draft: RowDraft, asked: Sequence[int], label: str) -> list[int]:
    """The proposals the verifier may test: each row's length capped at what it asked for.
    ``draft`` must be a :class:`RowDraft` of ``B`` rows with ``int`` tokens ``[B, n_max]``;
    anything else is the plugin's fault and raises :class:`~foretell.errors.DraftError`
    naming ``label`` (ids outside the vocabulary are rejected at verification, on the
    device)."""
    from foretell.errors import DraftError

    rows = len(asked)
    if not isinstance(draft, RowDraft) or not isinstance(draft.tokens, mx.array):
        raise DraftError(f"{label}: draft() must return a RowDraft, got {type(draft).__name__}")
    shape = draft.tokens.shape
    if len(shape) != 2 or shape[0] != rows or len(draft.lengths) != rows:
        raise DraftError(f"{label}: a draft for {rows} rows must have tokens [{rows}, n] and "
                         f"{rows} lengths, got tokens {list(shape)} and "
                         f"{len(draft.lengths)} lengths")
    if not mx.issubdtype(draft.tokens.dtype, mx.integer):
        raise DraftError(f"{label}: draft tokens must be integers, got {draft.tokens.dtype}")
    if draft.q is not None and (not isinstance(draft.q, mx.array)
                                or draft.q.shape[:2] != tuple(shape) or draft.q.ndim != 3):
        raise DraftError(f"{label}: q must be [{rows}, {shape[1]}, vocab], got "
                         f"{getattr(draft.q, 'shape', type(draft.q).__name__)}")
    lengths = []
    for n, want in zip(draft.lengths, asked):
        if type(n) is not int or n < 0:
            raise DraftError(f"{label}: draft lengths must be non-negative ints, got {n!r}")
        lengths.append(min(n, want, shape[1]))
    return lengths

