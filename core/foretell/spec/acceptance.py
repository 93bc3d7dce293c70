"""Which drafts the target keeps, and the token it adds: the verifier's acceptance rules.

Every rule returns ``[B]`` accepted counts and ``[B]`` tokens the target chose after them,
lazily (the verifier reads both with the round's one host sync). Drafts come as the caller
made them safe to run through the target: ``usable`` is False where the drafter's id lay
outside the vocabulary (the caller put an in-range stand-in there); such a position is a
rejection under every rule, so a drafter's id is emitted only where the target would have
chosen it.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from foretell.sampling import RandomKeys, Sampler, repetition_windows
from foretell.spec.contract import usable_distributions


def match_drafts(sampler: Sampler, scores: mx.array, drafts: mx.array, usable: mx.array,
                 key: mx.array | None) -> tuple[mx.array, mx.array]:
    """Keep drafts while they equal the target's own choice (its argmax when greedy).

    ``scores`` ``[B, n + 1, V]``, ``drafts`` and ``usable`` ``[B, n]``.
    """
    B, rows, vocab = scores.shape
    chosen = sampler.sample(scores.reshape(B * rows, vocab), key).reshape(B, rows)
    accepted = prefix_length(mx.logical_and(drafts == chosen[:, :-1], usable))
    return accepted, mx.take_along_axis(chosen, accepted[:, None], axis=1)[:, 0]


def accept_or_resample(
    p: mx.array, drafts: mx.array, q: mx.array | None, key: mx.array,
    usable: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Rejection sampling over ``[B]`` rows: keep draft i with probability
    ``min(1, p_i(d_i) / q_i(d_i))``; then draw the target's token from the residual.

    ``p`` ``[B, n + 1, V]`` target distributions, ``drafts`` ``[B, n]``, ``q`` ``[B, n, V]``
    (None: point masses on the drafts). A position the rule cannot judge is rejected and
    the token there drawn from ``p`` itself, not from the residual: an unusable id, a ``q``
    row that is no distribution (:func:`~foretell.spec.contract.usable_distributions`), or
    ``q(d) = 0`` (no drafter draws what it gave no chance). So whatever ``q`` a drafter
    reports, the token at such a position has the target's distribution given what precedes
    it, and a token the target gives no chance is never emitted (docs/decisions.md).
    Returns accepted counts and chosen tokens, ``[B]``, and ``[B]`` whether some ``q`` row
    was unusable.
    """
    B, rows, vocab = p.shape
    accept_key, resample_key = mx.random.split(key)
    ids_ok = mx.ones(drafts.shape, mx.bool_) if usable is None else usable
    q_ok = mx.ones(drafts.shape, mx.bool_)
    if q is None:
        q = (mx.arange(vocab)[None, None, :] == drafts[..., None]).astype(p.dtype)
    else:
        q = q.astype(p.dtype)
        q_ok = usable_distributions(q)
    p_d = mx.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    q_ok = mx.logical_and(q_ok, q_d > 0)
    judged = mx.logical_and(ids_ok, q_ok)
    bad_q = mx.any(mx.logical_and(ids_ok, mx.logical_not(q_ok)), axis=-1)
    # A lying q must not shape the residual either: where a draft is not judged, p alone.
    q = mx.where(judged[..., None], q, 0.0)
    u = mx.random.uniform(shape=drafts.shape, key=accept_key)
    accepted = prefix_length(mx.logical_and(u * q_d < p_d, judged))
    # After a full acceptance the extra token comes from p itself (q is zero there).
    q_padded = mx.concatenate([q, mx.zeros((B, 1, vocab), p.dtype)], axis=1)
    at = accepted[:, None, None]
    p_next = mx.take_along_axis(p, at, axis=1)[:, 0]
    q_next = mx.take_along_axis(q_padded, at, axis=1)[:, 0]
    weights = residual(p_next, q_next)
    chosen = mx.random.categorical(mx.log(weights), key=resample_key).astype(mx.int32)
    return accepted, chosen, bad_q


def residual(p: mx.array, q: mx.array) -> mx.array:
    """``max(p - q, 0)`` (unnormalized; a draw normalizes). Where p <= q everywhere the row
    was accepted with certainty, so any fallback is unreachable; p keeps the draw defined."""
    weights = mx.maximum(p - q, 0.0)
    return mx.where(mx.sum(weights, axis=-1, keepdims=True) > 0, weights, p)


def prefix_length(ok: mx.array) -> mx.array:
    """``[B, n]`` booleans to ``[B]`` lengths of their all-true prefixes."""
    return mx.sum(mx.cumprod(ok.astype(mx.int32), axis=-1), axis=-1).astype(mx.int32)


#: Bits of a judged row's ``flags``: what the drafter returned that the rules rejected.
OUT_OF_VOCAB, NOT_A_DISTRIBUTION = 1, 2


def judge_row(sampler: Sampler, logits: mx.array, drafts: mx.array, usable: mx.array,
              q: mx.array | None, keys: RandomKeys | None, position: int, *,
              token_match: bool, recent: Sequence[int] = ()) -> mx.array:
    """One request's draft judged by its own rule: the single-request verifier and the
    batch's (:func:`foretell.spec.batch.verify_rows`) both call this, so a row is kept or
    rejected the same way alone and in a batch.

    ``logits [n + 1, V]`` after the pending token and each of ``drafts [n]`` (``usable``:
    their ids lay in the vocabulary); ``q [1, n, V]`` or None (point masses); ``keys`` the
    request's position keys (None: greedy); ``position`` the first draft's index in the
    sequence; ``recent`` the tokens before it the repetition penalty sees. Greedy and
    token-match keep drafts equal to the target's own draw at each position; otherwise
    rejection sampling. Returns ``int32 [3 + n]``: accepted count, the target's token after
    them, :data:`OUT_OF_VOCAB` / :data:`NOT_A_DISTRIBUTION` flags, then the drafts."""
    n = drafts.shape[0]
    windows = None
    if sampler.window:
        windows = repetition_windows(mx.array(list(recent), dtype=mx.int32), drafts,
                                     sampler.window)
    scores = sampler.scores(logits, windows)[None]  # [1, n + 1, V]
    flags = OUT_OF_VOCAB * mx.any(mx.logical_not(usable)).astype(mx.int32)[None]
    if sampler.greedy or token_match:
        rows = keys.rows(position, n + 1) if keys is not None else None
        accepted, chosen = match_drafts(sampler, scores, drafts[None], usable[None], rows)
    else:
        accepted, chosen, bad_q = accept_or_resample(
            sampler.probabilities(scores), drafts[None], q,
            keys.rows(position, 1, salt=1)[0], usable[None])
        flags = flags + NOT_A_DISTRIBUTION * bad_q.astype(mx.int32)
    return mx.concatenate([accepted, chosen, flags, drafts.astype(mx.int32)])


def distrust_message(label: str, flags: int, vocab: int) -> str:
    """What to tell the user once the rules rejected what drafter ``label`` returned."""
    what = [text for bit, text in (
        (OUT_OF_VOCAB, f"token ids outside the vocabulary [0, {vocab})"),
        (NOT_A_DISTRIBUTION, "draft distributions q that are not distributions (an "
         "entry negative or not finite, a total off 1, or 0 at the drafted id)"),
    ) if flags & bit]
    return (f"{label} proposed {' and '.join(what)}; those drafts were rejected and the "
            f"target chose the tokens there itself")
