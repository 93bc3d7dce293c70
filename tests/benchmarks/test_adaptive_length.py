"""``benchmarks/adaptive_length.py``: where an adaptive run's time went, from what its
policy was told (the warm-up's drafted rounds, plain steps, tokens a round after)."""

from __future__ import annotations

import pytest
from benchscript import load

spent = load("adaptive_length").spent


def test_a_fresh_run_s_time_splits_into_warm_up_plain_steps_and_drafting():
    told = [(4, 0, 40.0, "first"), (4, 1, 40.0, "timed"), (4, 0, 40.0, "timed"),
            (0, 0, 20.0, "timed"),  # a plain stretch: one timed step of several
            (4, 4, 40.0, "untimed"), (4, 2, 40.0, "timed"), (0, 0, 30.0, "timed"),
            (3, 3, 36.0, "first")]
    got = spent(told, 20)
    # Drafted rounds made 1 + 2 + 1 + 5 + 3 + 4 = 16 tokens; the other 4 were plain steps,
    # each at the median of the timed ones (25 ms).
    assert got["plain_tokens"] == 4
    total = 5 * 40.0 + 36.0 + 4 * 25.0
    assert got["warmup"] == pytest.approx(120.0 / total)
    assert got["plain"] == pytest.approx(100.0 / total)
    assert got["per_round"] == pytest.approx((5 + 3 + 4) / 3)


def test_a_run_that_never_stepped_plainly_spent_nothing_there():
    got = spent([(4, 4, 40.0, "first"), (4, 4, 40.0, "timed")], 10)
    assert got["plain"] == 0.0 and got["plain_tokens"] == 0 and got["per_round"] == 0.0
    assert got["warmup"] == pytest.approx(1.0)
    assert spent([], 10) is None
