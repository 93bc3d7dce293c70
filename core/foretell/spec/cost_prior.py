"""What a drafted token costs, as a drafter declares it before any round is timed.

Decoding a token reads every weight once, so a draft model declares its weights' bytes over
the target's as what drafting one token costs in the target's decode steps: exact where the
target drafts for itself (1), an estimate otherwise (a GPU runs a small draft launch-bound,
dearer than its bytes). A round drafting ``k`` runs the target over ``k + 1`` tokens, at least
one decode step, so it costs at least ``1 + k * cost`` steps and yields at most ``1 + k``
tokens: at a declared cost of 1 or more no length can pay, whatever the acceptance. The
length policy then skips its blind warm-up (three rounds that lost ~4 plain steps of a
96-token request when the target drafted for itself) and drafts only as a probe its
exploring budget pays for; the first timed round overrules the declaration. A cost under 1
changes nothing: a bound that says drafting might pay is what the warm-up finds out anyway.
Figures: docs/decisions.md, "Session 35, the cost prior".
"""

from __future__ import annotations

import math
from typing import Any

from foretell.errors import DraftError


def cannot_pay(cost: float | None) -> bool:
    """Whether a declared per-token cost rules out every draft length: a round drafting
    ``k`` costs at least ``1 + k * cost`` plain steps for at most ``1 + k`` tokens."""
    return cost is not None and cost >= 1.0


def finite_number(x: object) -> bool:
    """Whether ``x`` is a finite int or float (not a bool): what a declared number may be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def declared_draft_cost(provider: Any, label: str) -> float | None:
    """The provider's ``draft_cost()`` (called after ``prepare``): one drafted token's cost
    in the target's decode steps, or None where it declares none (or has no such method).

    :raises DraftError: the method raised, or returned something other than a finite
        number >= 0 (``label`` names the provider)."""
    declare = getattr(provider, "draft_cost", None)
    if declare is None:
        return None
    try:
        cost = declare()
    except Exception as exc:
        raise DraftError(f"{label} failed in draft_cost(): {type(exc).__name__}: {exc}") from exc
    if cost is None:
        return None
    if not finite_number(cost) or cost < 0:
        raise DraftError(f"{label}: draft_cost() must return None or a finite number >= 0 "
                         f"(a drafted token's cost in target decode steps), got {cost!r}")
    return float(cost)
