"""The contract every architecture plugin implements, and the engine relies on.

An architecture builder (registered with ``foretell_register_architectures``) takes the
parsed ``config.json`` and returns a :class:`Model`. Weights are loaded by the core
(:mod:`foretell.model.loading`): the model exposes its parameters as an ``mlx.nn.Module`` and a
``sanitize`` step maps checkpoint names onto them.

Shapes: ``tokens`` is ``int32 [B, L]``; hidden states are ``[B, L, hidden_size]``;
logits are ``[B, L, vocab_size]``. ``hidden`` returned by ``forward`` is the final-normed
hidden state, i.e. exactly what ``logits`` consumes; drafters that read it (MTP heads) see
what the LM head sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

#: Capability ports a drafter may require of its target. A drafter that needs a port the
#: target lacks is refused before anything is allocated, naming both.
PORT_TAPS = "taps"  # forward(..., taps=(layer indices,)) returns those layers' outputs
PORT_MTP = "mtp"  # the checkpoint carries a multi-token-prediction head (mtp.* weights)


@runtime_checkable
class Cache(Protocol):
    """Per-layer KV state. ``offset`` counts every token the layer has seen."""

    offset: int

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append ``[B, heads, L, dim]`` keys/values; return what attention should read."""

    def is_trimmable(self) -> bool:
        """Whether ``trim`` can drop the newest tokens exactly (a wrapped ring cannot)."""

    def trim(self, n: int) -> int:
        """Drop up to ``n`` newest tokens; return how many were dropped."""

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The arrays holding the cached keys/values (what prefill evaluates and codecs
        snapshot); empty before the first update."""


@runtime_checkable
class Model(Protocol):
    """A loaded causal language model.

    Optional: ``make_batch_caches(*, bits=None, group_size=64) -> list`` for a model whose
    caches core's batch (:class:`foretell.model.batch.BatchKVCache`) cannot hold; the batch
    scheduler then runs its rows in those (``batch_caches`` calls it). Each layer's batch
    cache has what the scheduler uses of core's: ``append([single caches])`` (rows join,
    copied), ``filter(keep)``, ``extract(row)`` (a single cache as ``make_caches`` builds
    it), ``trim([count per row])``, ``lengths`` (tokens per row), ``rows``, ``nbytes`` and
    ``state``, and the model's ``forward`` takes the list. ``trims_rows = False`` (the same
    on every layer) says rows cannot roll back by different counts: the scheduler then
    drafts for none of them. A layer it cannot batch raises ``TypeError`` naming the model
    type and the layer's cache kind.
    """

    model_type: str
    vocab_size: int
    #: Ports from above this model offers (e.g. ``{"taps"}``).
    capabilities: frozenset[str]

    def make_caches(self) -> list[Any]:
        """Fresh, empty per-layer caches for one sequence."""

    def forward(
        self, tokens: mx.array, caches: list[Any] | None = None, taps: Sequence[int] = ()
    ) -> tuple[mx.array, dict[int, mx.array]]:
        """Run the decoder over ``tokens``, extending ``caches``; return the final-normed
        hidden states and ``{layer index: that layer's output}`` for each requested tap."""

    def logits(self, hidden: mx.array) -> mx.array:
        """Project hidden states to vocabulary logits (soft-capped where configured)."""

    def embed(self, tokens: mx.array) -> mx.array:
        """The input embedding of ``tokens`` as the first layer sees it (scaled if the
        architecture scales it)."""

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint tensor names/layouts onto this model's parameters."""
