"""The format of a draft-length policy's state (:meth:`DraftLengthPolicy.state`), what another
process recalls through :mod:`foretell.spec.memory`, and the check of one read from a file:
a state comes from disk, so every field is checked before the policy takes it."""

from __future__ import annotations

from foretell.spec.cost_prior import finite_number

#: The format of :meth:`DraftLengthPolicy.state`; a state of another format is refused.
STATE_FORMAT = 1
#: The most plain-step timings a state's costs are taken to rest on: a state blends what a
#: process timed into what it recalled by their timings, so older processes' weigh at most
#: this many and a lasting change shows within a few processes.
STATE_TIMINGS = 8
#: The most draft positions (and lengths) a state may describe.
STATE_MAX_K = 64


def checked_state(state: object) -> tuple[list[float], list[float], list[float], int, float]:
    """``(accepted, offered, costs, timings, plain_s)`` of a :meth:`DraftLengthPolicy.state`.

    :raises ValueError: naming the first field that is not as the format says."""
    if not isinstance(state, dict):
        raise ValueError(f"a state is a JSON object, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"format: {state.get('format')!r}, this version reads {STATE_FORMAT}")
    pairs, costs = state.get("acceptance"), state.get("costs")
    if not isinstance(pairs, list) or not 1 <= len(pairs) <= STATE_MAX_K:
        raise ValueError(f"acceptance: a list of 1 to {STATE_MAX_K} [accepted, offered] pairs")
    if not isinstance(costs, list) or not 1 <= len(costs) <= STATE_MAX_K:
        raise ValueError(f"costs: a list of 1 to {STATE_MAX_K} numbers")
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, list) and len(pair) == 2 and all(map(finite_number, pair))
                and 0 <= pair[0] <= pair[1] <= 1e6):
            raise ValueError(f"acceptance[{i}]: expected [accepted, offered] with "
                             f"0 <= accepted <= offered, got {pair!r}")
    if pairs[0][1] <= 0:
        raise ValueError("acceptance[0]: no round was offered")
    for i, cost in enumerate(costs):
        # A round drafting k tokens costs at least a plain step, and no sane one 1000.
        if not (finite_number(cost) and 1.0 <= cost <= 1e3):
            raise ValueError(f"costs[{i}]: expected a number in [1, 1000], got {cost!r}")
    timings = state.get("timings", 0)
    if not (type(timings) is int and 0 <= timings <= STATE_TIMINGS):
        raise ValueError(f"timings: expected an integer in [0, {STATE_TIMINGS}], got {timings!r}")
    plain = state.get("plain_s")
    if not (finite_number(plain) and 0 < plain <= 1e3):
        raise ValueError(f"plain_s: expected seconds in (0, 1000], got {plain!r}")
    return ([float(a) for a, _ in pairs], [float(o) for _, o in pairs],
            [float(c) for c in costs], timings, float(plain))
