"""One request's state, and the prefill that fills its caches.

:class:`RequestState` owns a request's sequence and, until it joins the scheduler's batch
(:mod:`foretell.scheduler`) and again when it leaves it, its caches; :func:`prefill` feeds
prompt tokens into them in chunks. The scheduler's step advances every running request
(:mod:`foretell.batch_step`); :class:`foretell.stream.StreamCut` decides where each ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import mlx.core as mx

if TYPE_CHECKING:
    from foretell.model import Model

#: Prompt tokens per prefill forward pass; bounds activation memory on long prompts.
PREFILL_CHUNK = 2048

#: MLX's allocator keeps freed buffers for reuse, and a long prefill's chunk-sized ones
#: would pile up: past this many cached bytes a prefill releases them. Not after every
#: prefill: on CUDA releasing returns each buffer to the driver and the next forward
#: allocates them afresh, a tax on every admission of a server under load.
CACHE_KEEP_BYTES = 1 << 30

Progress = Callable[[int, int], None]


def release_buffers() -> None:
    """Free MLX's cached buffers once they exceed :data:`CACHE_KEEP_BYTES`."""
    if mx.get_cache_memory() > CACHE_KEEP_BYTES:
        mx.clear_cache()


@attrs.define(eq=False)
class RequestState:
    """One request's sequence, and the one owner of its caches.

    ``caches`` hold the KV of a prefix of ``prompt + generated``: step sources feed tokens
    into them, trim them on rollback and append what they produce to ``generated``. The
    stream decides where the request ended (EOS, a stop string, ``max_tokens``) and records
    it in ``consumed`` and ``finish_reason``; tokens a step produced past that point (the rest
    of a speculative burst, a step already in flight) stay in ``generated`` and may be in the
    caches, so whoever persists the caches knows exactly what they hold (:meth:`held_tokens`).
    """

    prompt: list[int]
    caches: list[Any]
    #: Leading prompt tokens the caches held when the request started (a prefix-cache hit).
    cached: int = 0
    generated: list[int] = attrs.Factory(list)
    #: How many of ``generated`` the stream took (emitted text, plus EOS when it ended there).
    consumed: int = 0
    finish_reason: str | None = None
    #: The cache tier the prefix came from ("ram", "ssd", "checkpoint"), None if computed.
    cached_from: str | None = None
    #: The request's random stream (None when greedy); a resumed request continues its own.
    keys: Any = None
    #: Leading ``generated`` tokens restored from the request's checkpoint, not computed.
    resumed: int = 0

    @property
    def held(self) -> int:
        """Tokens of the sequence the caches hold (every layer holds the same number)."""
        return self.caches[0].offset if self.caches else 0

    def held_tokens(self) -> list[int]:
        """The token ids whose KV the caches hold, in order."""
        return (self.prompt + self.generated)[: self.held]

    def ended_sequence(self) -> list[int]:
        """``prompt`` plus the generated tokens the stream took: what the request produced."""
        return self.prompt + self.generated[: self.consumed]


def prefill(
    model: Model,
    tokens: Sequence[int] | mx.array,
    caches: list[Any],
    progress: Progress | None = None,
    *,
    keep_hidden: bool = False,
) -> mx.array | None:
    """Feed ``tokens`` (one sequence) through ``model`` into ``caches``, in chunks.

    Returns the final-normed hidden states ``[1, len(tokens), H]`` when ``keep_hidden``
    (drafters that read the target's hidden states need them), else None.
    """
    tokens = tokens if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.int32)
    total = tokens.size
    hiddens = []
    done = 0
    while done < total:
        n = min(PREFILL_CHUNK, total - done)
        hidden, _ = model.forward(tokens[None, done : done + n], caches)
        if keep_hidden:
            hiddens.append(hidden)
            mx.eval([cache.state for cache in caches], hidden)
        else:
            # Evaluate only the caches: MLX then skips what nothing reads (the last layer's
            # attention output and MLP for these positions), measured 1.5-2x faster here.
            mx.eval([cache.state for cache in caches])
        release_buffers()  # chunk-sized buffers would otherwise pile up
        done += n
        if progress is not None:
            progress(done, total)
    if not keep_hidden:
        return None
    if not hiddens:
        return mx.zeros((1, 0, 0))
    return hiddens[0] if len(hiddens) == 1 else mx.concatenate(hiddens, axis=1)


def prefill_rows(
    model: Model,
    todo: Sequence[Sequence[int]],
    caches: Sequence[list[Any]],
    *,
    shared: list[Any] | None = None,
    chunk: int | None = None,
) -> tuple[list[list[Any]], mx.array]:
    """Several rows' tokens (``todo[b]`` after what row ``b``'s single ``caches[b]`` hold)
    through ``model`` together: the rows joined in one batch cache (``shared``, else
    :func:`~foretell.model.batch_caches`'), the shorter padded, one forward per ``chunk``
    positions (default: a single prefill's tokens, :data:`PREFILL_CHUNK`, over the rows), the
    padding trimmed off. Returns each row's caches after its tokens (fresh single caches; the
    given ones stay as they were) and the forwards' hidden states ``[B, width, H]`` (row
    ``b``'s first ``len(todo[b])`` positions are its own). On CPUs a wide forward uses the
    matrix units better than several narrow ones."""
    from foretell.model.batch import batch_caches

    joined = shared if shared is not None else batch_caches(model)
    for layer, cache in enumerate(joined):
        cache.append([row[layer] for row in caches])
    width = max(len(t) for t in todo)
    tokens = mx.array([list(t) + [0] * (width - len(t)) for t in todo], dtype=mx.int32)
    step = chunk or max(1, PREFILL_CHUNK // len(todo))
    hiddens = []
    for lo in range(0, width, step):
        hidden, _ = model.forward(tokens[:, lo : lo + step], joined)
        hiddens.append(hidden)
        if lo + step < width:
            # The caches only, where they are plain buffers: MLX then skips the last layer's
            # output for these positions unless a caller reads it (as prefill() does).
            held = [getattr(cache, "buffers", None) for cache in joined]
            mx.eval(held if all(h is not None for h in held) else hidden)
            release_buffers()
    for cache in joined:
        cache.trim([width - len(t) for t in todo])
    rows = [[cache.extract(b) for cache in joined] for b in range(len(todo))]
    return rows, hiddens[0] if len(hiddens) == 1 else mx.concatenate(hiddens, axis=1)
