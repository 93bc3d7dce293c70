"""Choosing tokens from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.

One :class:`Sampler` serves plain decoding and speculative verification alike: ``scores``
turns logits ``[N, V]`` into the distribution tokens are drawn from, ``sample`` draws, and
the verifier's acceptance test reads ``probabilities(scores)``, so drafts are checked
against exactly the distribution plain decoding samples. It matches mlx-lm's rounding
included (log-probabilities in the logits' dtype; top-p and min-p, then top-k, then
temperature). A per-request :class:`RandomKeys` makes a seed reproduce a run whatever else
the process has drawn.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

if TYPE_CHECKING:
    from foretell.config import SamplingConfig


class RandomKeys:
    """A request's randomness: keys for sequence positions, and a stream of fresh keys.

    :meth:`rows` keys each sequence position by ``(seed, position)`` alone, so the token
    drawn for position i is the same whichever way the generation was cut into steps and
    rounds: plain decoding and the verifier draw with them (a seed then reproduces a
    speculative run whatever its draft schedule). :meth:`next` is a stream, for a drafter's
    own draws (:func:`foretell.spec.draft_keys`)."""

    def __init__(self, seed: int | None = None):
        self.seed = secrets.randbits(32) if seed is None else seed
        self._key = mx.random.key(self.seed)

    def state(self) -> list[int]:
        """The stream's current key (checkpoints store it; :meth:`restored` resumes it)."""
        return [int(x) for x in self._key.tolist()]

    @classmethod
    def restored(cls, seed: int | None, state: list[int] | tuple[int, ...]) -> RandomKeys:
        """The stream of ``seed`` continued from a :meth:`state`."""
        keys = cls(seed)
        keys._key = mx.array(list(state), dtype=mx.uint32)
        return keys

    def next(self) -> mx.array:
        # Splitting is a lazy graph op: no host sync on the per-token path.
        pair = mx.random.split(self._key)
        self._key = pair[0]
        return pair[1]

    def rows(self, position: int, count: int = 1, salt: int = 0) -> mx.array:
        """``[count, 2]`` keys of positions ``position ...``: :func:`position_keys`."""
        return position_keys(self.seed, position, count, salt)


def position_keys(seed: int, position: int, count: int = 1, salt: int = 0) -> mx.array:
    """``[count, 2]`` PRNG keys of sequence positions ``position ... position + count - 1``,
    each a function of ``(seed, position, salt)`` only (``salt`` separates uses of one
    position). Hashed on the host (splitmix64) into one small upload: no graph ops, no sync."""
    return mx.array(_key_rows(seed, position, count, salt), dtype=mx.uint32).reshape(count, 2)


def _key_rows(seed: int, position: int, count: int = 1, salt: int = 0) -> list[list[int]]:
    base = _splitmix64(_splitmix64(seed & _MASK64) ^ (salt * 0x9E3779B97F4A7C15 & _MASK64))
    rows = []
    for i in range(position, position + count):
        h = _splitmix64(base ^ i)
        rows.append([h >> 32, h & 0xFFFFFFFF])
    return rows


def draw_rows(logits: mx.array, rows: Sequence[tuple[Sampler, RandomKeys | None, int]]
              ) -> mx.array:
    """One plain step's tokens for a batch: ``logits [B, V]``, row ``b`` drawn by
    ``rows[b] = (sampler, keys, position)`` exactly as that request's own plain step draws
    (its sampler, the key of its position). Rows sharing sampling
    settings are drawn in one call, and greedy rows all in one: without a penalty window a
    greedy draw reads no setting. Returns ``int32 [B]``."""
    groups: dict[Any, list[int]] = {}
    for b, (sampler, _, _) in enumerate(rows):
        groups.setdefault(None if sampler.greedy else sampler.config, []).append(b)
    parts, order = [], []
    for members in groups.values():
        sampler = rows[members[0]][0]
        whole = len(members) == len(rows)
        part = logits if whole else logits[mx.array(members, dtype=mx.int32)]
        keys = None
        if not sampler.greedy:
            keys = mx.array([_key_rows(rows[b][1].seed, rows[b][2])[0] for b in members],
                            dtype=mx.uint32)
        parts.append(sampler(part, None, keys))
        order.extend(members)
    if len(parts) == 1:
        return parts[0]
    where = [0] * len(order)
    for i, b in enumerate(order):
        where[b] = i
    return mx.concatenate(parts)[mx.array(where, dtype=mx.int32)]


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def gumbel_rows(keys: mx.array, vocab: int) -> mx.array:
    """``[N, vocab]`` Gumbel noise, row r drawn from ``keys[r]`` alone (its values do not
    depend on how many rows are drawn together), so ``argmax(scores + noise)`` draws each
    row's token as a function of its own key."""
    return mx.vmap(lambda key: mx.random.gumbel((vocab,), key=key))(keys)


class Sampler:
    """Logits to a processed distribution, and draws from it.

    ``scores(logits, windows)`` returns ``[N, V]`` scores whose softmax is the distribution
    tokens are drawn from: for sampling, the masked log-probabilities over the temperature
    (float32); for greedy (``temp == 0``), the penalized log-probabilities in the logits'
    dtype, whose argmax is mlx-lm's greedy token even where bfloat16 rounding ties two.
    ``probabilities(scores)`` is that distribution, ``[N, V]`` summing to 1 per row; for
    greedy, the point mass at the argmax, so one rejection-sampling verifier serves both.
    ``sample(scores, key)`` returns ``[N]`` int32 ids: exactly the argmax when greedy; with
    ``[N, 2]`` keys (:meth:`RandomKeys.rows`), row r's draw is a function of ``keys[r]`` and
    its scores alone (Gumbel-max), which is how plain decoding and the verifier draw.
    """

    def __init__(self, config: SamplingConfig | None = None):
        from foretell.config import SamplingConfig

        self.config = config or SamplingConfig()
        c = self.config
        self.greedy = c.temp == 0
        self.penalty = c.repetition_penalty if c.repetition_penalty != 1.0 else None
        #: How many recent tokens the repetition penalty sees (0 when it is off).
        self.window = c.repetition_context_size if self.penalty is not None else 0
        self._top_k = c.top_k
        self._top_p = c.top_p if c.top_p < 1.0 else None
        self._log_min_p = math.log(c.min_p) if c.min_p > 0.0 else None
        self._inv_temp = 1.0 / c.temp if c.temp > 0 else None

    def keys(self) -> RandomKeys | None:
        """The random stream for one request, or None when greedy needs none."""
        return None if self.greedy else RandomKeys(self.config.seed)

    def scores(self, logits: mx.array, windows: mx.array | None = None) -> mx.array:
        """``[N, V]`` logits (and ``[N, W]`` recent tokens per row) to the distribution."""
        if self.penalty is not None and windows is not None and windows.size:
            logits = apply_repetition_penalty(logits, windows, self.penalty)
        # mlx-lm ranks these, rounded to the model's dtype; float32 logits ranked a bfloat16
        # model's tokens differently where rounding ties two (docs/generation.md).
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.greedy:
            return logprobs
        return (self._masked(logprobs) * self._inv_temp).astype(mx.float32)

    def probabilities(self, scores: mx.array) -> mx.array:
        if self.greedy:
            best = mx.argmax(scores, axis=-1, keepdims=True)
            return (mx.arange(scores.shape[-1]) == best).astype(mx.float32)
        return mx.softmax(scores, axis=-1)

    def sample(self, scores: mx.array, key: mx.array | None = None) -> mx.array:
        if self.greedy:
            return mx.argmax(scores, axis=-1).astype(mx.int32)
        if key is not None and key.ndim == 2:
            noise = gumbel_rows(key, scores.shape[-1])
            return mx.argmax(scores + noise, axis=-1).astype(mx.int32)
        return mx.random.categorical(scores, axis=-1, key=key).astype(mx.int32)

    def __call__(
        self, logits: mx.array, windows: mx.array | None, key: mx.array | None
    ) -> mx.array:
        return self.sample(self.scores(logits, windows), key)

    def _masked(self, logprobs: mx.array) -> mx.array:
        """``logprobs`` with what top-p, min-p and top-k drop set to -inf, in mlx-lm's order:
        top-p and min-p judge the untempered distribution, then top-k keeps ``k`` of what
        survives (so its ties break on the same array as mlx-lm's do)."""
        drop = None
        vocab = logprobs.shape[-1]
        top_k = self._top_k if 0 < self._top_k < vocab else 0
        if self._top_p is not None:
            # Only the top-k can be kept, so only they are sorted (docs/generation.md says
            # where that can differ from mlx-lm's full sort).
            candidates = top_k_values(logprobs, top_k) if top_k else logprobs
            drop = top_p_drop(logprobs, candidates, self._top_p)
        if self._log_min_p is not None:
            best = mx.max(logprobs, axis=-1, keepdims=True)
            drop = _or(drop, logprobs < best + self._log_min_p)
        if drop is not None:
            logprobs = mx.where(drop, mx.array(-mx.inf, logprobs.dtype), logprobs)
        if top_k:
            logprobs = mx.where(top_k_drop(logprobs, top_k), mx.array(-mx.inf, logprobs.dtype),
                                logprobs)
        return logprobs


def _or(a: mx.array | None, b: mx.array) -> mx.array:
    return b if a is None else mx.logical_or(a, b)


def top_k_drop(logprobs: mx.array, k: int) -> mx.array:
    """True for all but exactly ``k`` tokens per row.

    Ties at the cut keep only as many tokens as fit, chosen as mlx-lm chooses them: by the
    same ``argpartition`` on the same values (on MLX's CPU backend, the lower token ids
    win), so ``top_k = 1`` keeps the argmax. Partition, not sort: linear in the vocabulary.
    """
    dropped = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(mx.zeros(logprobs.shape, mx.bool_), dropped, mx.array(True),
                             axis=-1)


def top_k_values(logprobs: mx.array, k: int) -> mx.array:
    """The ``k`` largest values of each row, unordered."""
    return mx.take_along_axis(logprobs, mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., :k],
                              axis=-1)


def top_p_drop(logprobs: mx.array, candidates: mx.array, top_p: float) -> mx.array:
    """True for tokens outside the smallest set whose probability reaches ``top_p``,
    computed as mlx-lm computes it (float32 probabilities of the given log-probabilities).

    ``candidates`` holds every value that could be kept (all of ``logprobs``, or the
    top-k): only they are sorted, since on the CPU the sort is most of the cost; the total
    mass is still the full vocabulary's. Ties with the last kept token are kept
    too, so the result does not depend on sort order.
    """
    ordered = mx.sort(candidates, axis=-1)  # ascending: the best is last
    probs = mx.exp(ordered.astype(mx.float32))
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)  # mass strictly ahead
    if candidates is logprobs:
        total = above[..., :1] + probs[..., :1]
    else:
        total = mx.sum(mx.exp(logprobs.astype(mx.float32)), axis=-1, keepdims=True)
    dropped = mx.sum(above >= top_p * total, axis=-1, keepdims=True)  # the best never is
    threshold = mx.take_along_axis(ordered, dropped, axis=-1)
    return logprobs < threshold


def apply_repetition_penalty(logits: mx.array, windows: mx.array, penalty: float) -> mx.array:
    """Make tokens in each row's window less likely (CTRL: divide positive logits by the
    penalty, multiply negative ones). Repeats within a window are penalized once."""
    picked = mx.take_along_axis(logits, windows, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    # A token repeated in a window writes the same value at each of its positions.
    return mx.put_along_axis(logits, windows, picked, axis=-1)


def repetition_windows(context: mx.array, appended: mx.array, size: int) -> mx.array:
    """``[N, W]`` windows of recent tokens for ``N = len(appended) + 1`` positions.

    Row ``i`` holds the last ``size`` tokens of ``context`` followed by ``appended[:i]`` (the
    verifier's view of draft position ``i``). While fewer than ``size`` tokens exist, a row is
    padded by repeating its own first token, which the penalty treats as one occurrence.
    """
    tail = context[-size:]
    seq = mx.concatenate([tail, appended]) if appended.size else tail
    known = tail.size
    rows = appended.size + 1
    width = min(size, known + rows - 1)
    ends = mx.arange(known, known + rows)[:, None]
    starts = mx.maximum(ends - size, 0)
    positions = mx.maximum(ends - width + mx.arange(width)[None, :], starts)
    return seq[positions]


class TokenConstraint(Protocol):
    """Limits which tokens a request may produce next (structured output: a grammar).

    The scheduler asks :meth:`allowed` before each of the row's draws and reports the token
    drawn with :meth:`accept`; once :meth:`complete` the request ends (finish reason
    ``"stop"``). Called on the scheduler's thread only: make the arrays it returns there
    (MLX streams belong to a thread)."""

    def allowed(self) -> mx.array | None:
        """``bool [vocab]`` (the model's logits width): True where a token may come next;
        None: any token."""

    def accept(self, token: int) -> None:
        """The row's next token is ``token`` (one ``allowed`` permitted)."""

    def complete(self) -> bool:
        """Whether the output is whole (nothing more may follow)."""
