"""The speculator a request drafts with, what its speculation reports, and how one is made.

Every drafter is verified by the one verifier, :func:`foretell.spec.batch.verify_rows`, one
target forward over every running row's draft (a request decoding alone is a batch of one).
Per row, the target decides every token (DESIGN.md invariant 1):

- greedy: a draft is kept while it equals the target's argmax, so the output is
  token-identical to plain greedy decoding;
- sampled, ``acceptance="rejection"`` (the default): draft ``d`` drawn from ``q`` is kept
  with probability ``min(1, p(d) / q(d))``; at the first rejection the target's token is
  drawn from ``max(p - q, 0)`` renormalized, and after a fully accepted draft from ``p``
  (Leviathan et al. 2023, Chen et al. 2023). ``p`` is exactly the distribution plain
  sampling draws from (:class:`~foretell.sampling.Sampler`), so the output distribution is
  plain sampling's;
- sampled, ``acceptance="token-match"``, and every seeded sampled request: the target
  samples each position itself, with the noise of that position's key (``RandomKeys.rows``,
  as plain decoding draws), and a draft is kept while it equals that sample. Exact, and the
  token at each position is then plain sampling's with that seed, whatever the drafter and
  the draft schedule: a seed reproduces the run. Drafters built on
  :class:`~foretell.spec.Drafting` draw a seeded request's drafts with the same noise, so
  they agree as often as a drafter that does not see ``p`` can (Daliri et al. 2024,
  "drafter-invariant speculative decoding"); rejection sampling accepts more, but its
  output depends on where drafts were offered.

The rules themselves are :func:`foretell.spec.acceptance.judge_row`.
"""

from __future__ import annotations

from typing import Any

import attrs

from foretell.spec.contract import PORT_HIDDEN, DraftError, Target
from foretell.spec.policy import DraftLengthPolicy

ACCEPTANCE_RULES = ("rejection", "token-match")


@attrs.frozen(kw_only=True)
class Speculator:
    """A prepared draft provider and how the verifier uses it."""

    kind: str
    provider: Any
    #: The most tokens drafted per round (``--num-draft-tokens``).
    max_tokens: int = 4
    #: Choose k per round from measured acceptance and cost; False drafts ``max_tokens``.
    adaptive: bool = True
    acceptance: str = attrs.field(default="rejection", validator=attrs.validators.in_(ACCEPTANCE_RULES))
    #: Who contributed the provider, for error messages.
    origin: str = ""
    #: Speculate on sampled requests too; False: those decode plainly, and only greedy ones
    #: speculate (``"sampled": false`` in a model's ``speculation.json``, where sampled
    #: drafting measured slower than plain decoding: docs/speculation.md).
    sampled: bool = True
    #: What drafting one token costs in the target's decode steps, as the provider declares
    #: it once prepared (``draft_cost()``; None: unknown): the length policy's prior on a
    #: round's cost before any round is timed (:mod:`foretell.spec.cost_prior`).
    draft_cost: float | None = None
    #: The draft-length policy, shared by this speculator's requests: what it measured of
    #: the machine and the drafter carries over, so only the first request pays the warm-up.
    policy: DraftLengthPolicy = attrs.field(init=False, eq=False, repr=False)

    @policy.default
    def _policy(self) -> DraftLengthPolicy:
        return DraftLengthPolicy(self.max_tokens, adaptive=self.adaptive,
                                 draft_cost=self.draft_cost)

    @property
    def wants_hidden(self) -> bool:
        return PORT_HIDDEN in frozenset(getattr(self.provider, "requires", ()))

    def label(self) -> str:
        return f"draft provider '{self.kind}'" + (f" from {self.origin}" if self.origin else "")


@attrs.define
class SpeculationStats:
    """What ``--json`` reports under ``speculation``."""

    drafter: str
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    produced: int = 0
    k_total: int = 0
    offered_at: list[int] = attrs.Factory(list)
    accepted_at: list[int] = attrs.Factory(list)
    #: Sequence tokens the drafter got back from the cache instead of computing them.
    draft_cached: int = 0

    def record(self, k: int, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.target_forwards += 1
        self.k_total += k
        self.drafted += drafted
        self.accepted += accepted
        self.produced += accepted + 1
        while len(self.offered_at) < drafted:
            self.offered_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.offered_at[i] += 1
            self.accepted_at[i] += i < accepted

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "acceptance_by_position": [
                a / o if o else 0.0 for a, o in zip(self.accepted_at, self.offered_at)
            ],
            "target_forwards": self.target_forwards,
            "tokens_per_target_forward": (
                self.produced / self.target_forwards if self.target_forwards else 0.0
            ),
            "mean_k": self.k_total / self.rounds if self.rounds else 0.0,
            "draft_cached_tokens": self.draft_cached,
        }


def _call(speculator: Speculator, what: str, fn: Any, *args: Any) -> Any:
    """Call into the drafter plugin; its failure ends this request with its name on it."""
    try:
        return fn(*args)
    except DraftError:
        raise
    except Exception as exc:
        raise DraftError(
            f"{speculator.label()} failed in {what}(): {type(exc).__name__}: {exc}"
        ) from exc


def make_speculator(
    registry: Any,
    target: Target,
    kind: str,
    options: Any = None,
    *,
    max_tokens: int | None = None,
    adaptive: bool = True,
    acceptance: str = "rejection",
    sampled: bool = True,
) -> Speculator:
    """Build, check and prepare the draft provider registered as ``kind`` for ``target``;
    ``max_tokens`` None drafts the provider's own preferred length (:func:`preferred_tokens`);
    ``sampled`` False leaves sampled requests to plain decoding.

    A pairing that cannot work is refused here, before any draft weights are allocated.
    """
    from foretell.plugin.registry import Kind
    from foretell.spec.contract import PairingError, missing_ports, preferred_tokens
    from foretell.spec.cost_prior import declared_draft_cost

    contribution = registry.get(Kind.DRAFT, kind)
    factory = contribution.load()
    origin = contribution.origin.describe()
    if options is None and contribution.config is not None:
        options = contribution.config()
    try:
        provider = factory(options) if contribution.config is not None else factory()
    except Exception as exc:
        raise DraftError(
            f"draft provider '{kind}' from {origin}: cannot be built: {type(exc).__name__}: {exc}"
        ) from exc
    missing = missing_ports(provider, target)
    if missing:
        raise PairingError(
            f"draft provider '{kind}' cannot draft for target {target.name}: it needs "
            f"{', '.join(sorted(missing))}, which the target ({target.model.model_type}) "
            "does not offer"
        )
    label = f"draft provider '{kind}' from {origin}"
    speculator = Speculator(
        kind=kind, provider=provider, max_tokens=max_tokens or preferred_tokens(provider, label),
        adaptive=adaptive, acceptance=acceptance, origin=origin, sampled=sampled,
    )
    try:
        provider.prepare(target)
    except (PairingError, DraftError):
        raise
    except Exception as exc:
        raise DraftError(
            f"{speculator.label()} failed in prepare(): {type(exc).__name__}: {exc}"
        ) from exc
    # Known once the draft weights are loaded; the policy is built afresh with it.
    return attrs.evolve(speculator, draft_cost=declared_draft_cost(provider, speculator.label()))

