"""The two-model draft source: a small model of the target's vocabulary proposes tokens.

The draft model keeps its own caches: each draft first feeds every sequence token they lack
in one forward, then the drafts it chains; ``commit`` trims that back to the accepted drafts.
Drafting chains ``n`` forwards lazily, so the drafts, the target's verify forward and the
acceptance test evaluate as one graph with one host sync (the verifier's).

It declares what a drafted token costs before any round is timed: the draft's weights' bytes
over the target's (decoding reads every weight once a token), exactly 1 where the target drafts
for itself, so the length policy does not spend a warm-up on a pairing that cannot pay.

Its state checkpoints (the cache stores it with the target's entries): the draft caches go
through the tier's KV codecs, the draft's random stream as keys; the identity is the draft
model's weights and config, so one draft model's caches never seed another's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from foretell.engine import resolve_model_path
from foretell.model import add_rollback_reserve, stay_trimmable, trim_all
from foretell.request import prefill
from foretell.spec import (
    CATCH_UP_MAX,
    Draft,
    Drafting,
    DraftState,
    Feed,
    PairingError,
    Target,
    draft_keys,
    files_fingerprint,
    resumed_keys,
)
from foretell.tokenizer import Tokenizer

#: Tokens one round may add to the draft's caches beyond the sequence (the verifier's cap).
ROUND_RESERVE = 16


def weights_bytes(model: Any) -> int:
    """The bytes of ``model``'s parameters as loaded: what one decode step reads."""
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


class TwoModelProvider:
    requires = frozenset()

    def __init__(self, config: Any):
        self.config = config
        self.path: Path | None = None
        self.model: Any = None
        self._fingerprint: str | None = None
        self._cost: float | None = None

    def prepare(self, target: Target) -> None:
        from foretell.model import load_model, read_config

        path = resolve_model_path(self.config.model)
        config = read_config(path)
        where = f"draft model {path} for target {target.name}"
        if config.get("vocab_size") != target.model.vocab_size:
            raise PairingError(
                f"{where}: vocabularies differ (draft {config.get('vocab_size')} tokens, "
                f"target {target.model.vocab_size}); a draft must share the target's tokenizer"
            )
        draft_vocab = Tokenizer.from_dir(path).backend.get_vocab(with_added_tokens=True)
        if draft_vocab != target.tokenizer.backend.get_vocab(with_added_tokens=True):
            raise PairingError(
                f"{where}: tokenizers differ (same size, different tokens); a draft must "
                "share the target's tokenizer"
            )
        if target.registry is None:
            raise PairingError(f"{where}: no plugin registry to build the draft model with")
        self.model = load_model(path, target.registry)
        self.path = path
        self._cost = weights_bytes(self.model) / max(weights_bytes(target.model), 1)
        self._fingerprint = files_fingerprint([path / "config.json", *path.glob("*.safetensors")])

    def draft_cost(self) -> float | None:
        """A drafted token's cost in the target's decode steps: the weights' bytes ratio
        (None before :meth:`prepare`)."""
        return self._cost

    def draft_identity(self) -> dict[str, Any]:
        # ROUND_RESERVE shapes the caches' stored form (the sliding reserve), so it is named.
        return {"weights": self._fingerprint, "reserve": ROUND_RESERVE, "version": 1}

    def open(self, target: Target, sampler: Any) -> TwoModelSource:
        return TwoModelSource(self.model, sampler)

    def open_rows(self, target: Target) -> Any:
        """Plugin API 2: every row of a batch drafted in one forward per token."""
        from foretell_two_model.rows import TwoModelRows

        return TwoModelRows(self.model)


class TwoModelSource:
    def __init__(self, model: Any, sampler: Any):
        self.model = model
        self.sampler = sampler
        self.keys = draft_keys(sampler)
        self.caches = self._fresh_caches()
        self.sequence: list[int] = []
        #: The caches hold ``sequence[base:fed]``, then the drafts they were fed.
        self.base = 0
        self.fed = 0
        self._drafted = 0

    def prefill(self, feed: Feed) -> None:
        self.sequence.extend(feed.tokens)
        todo = self.sequence[self.fed : -1]  # after a restore, only what the cache lacked
        prefill(self.model, todo, self.caches)
        self.fed += len(todo)

    def capture(self) -> DraftState:
        return DraftState(caches=list(self.caches), meta={"fed": self.fed, "base": self.base},
                          keys=self.keys.state() if self.keys is not None else None)

    def restore(self, state: DraftState, tokens: list[int]) -> None:
        # ``fed`` may run past ``tokens`` by the accepted drafts the next feed brings.
        fed, caches = int(state.meta["fed"]), list(state.caches)
        base = int(state.meta.get("base", 0))
        if len(caches) != len(self.caches) or any(c.offset != fed - base for c in caches):
            raise ValueError(f"stored draft caches ({len(caches)} layers holding "
                             f"{[c.offset for c in caches][:2]}... tokens) do not fit this "
                             f"draft model ({len(self.caches)} layers) at tokens {base}-{fed}")
        self.caches, self.sequence, self.fed, self.base = caches, list(tokens), fed, base
        self.keys = resumed_keys(self.keys, state)

    def _fresh_caches(self) -> list[Any]:
        caches = self.model.make_caches()
        add_rollback_reserve(caches, ROUND_RESERVE)
        return caches

    def _start_over(self) -> None:
        """Fresh caches that will hold the sequence's last CATCH_UP_MAX tokens (the
        contract's bound on a catch-up: ``foretell.spec.CATCH_UP_MAX``)."""
        self.caches = self._fresh_caches()
        self.base = self.fed = len(self.sequence) - CATCH_UP_MAX

    def draft(self, feed: Feed, n: int) -> Draft:
        self.sequence.extend(feed.tokens)
        # One forward takes every token the caches lack and gives the first draft (after a
        # fully kept round: the last draft and the target's token; after plain steps: theirs),
        # so n drafts cost n forwards: feeding the last draft apart would cost one more.
        if len(self.sequence) - self.fed > CATCH_UP_MAX:
            self._start_over()
        todo = self.sequence[self.fed :]
        hidden, _ = self.model.forward(mx.array([todo], dtype=mx.int32), self.caches)
        if not stay_trimmable(self.caches, n - 1):
            self.fed, self._drafted = len(self.sequence), 0
            return Draft.of([])  # a cache that could not roll back: the target steps alone
        drafting = Drafting(self.sampler, self.keys, feed.position)
        token = drafting.add(self.model.logits(hidden[:, -1, :]))
        for _ in range(n - 1):
            hidden, _ = self.model.forward(token[:, None], self.caches)
            token = drafting.add(self.model.logits(hidden[:, -1, :]))
        # The last draft was not fed: the caches hold the sequence plus n - 1 drafts.
        self.fed = len(self.sequence) + n - 1
        self._drafted = n
        return drafting.draft()

    def commit(self, accepted: int) -> None:
        fed_drafts = max(self._drafted - 1, 0)
        keep = min(accepted, fed_drafts)
        trim_all(self.caches, fed_drafts - keep)
        self.fed = len(self.sequence) + keep
        self._drafted = 0

    def close(self) -> None:
        self.caches = []
