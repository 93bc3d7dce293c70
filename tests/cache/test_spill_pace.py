"""The spill worker keeps to its duty cycle: after a write of t seconds it rests
t * (1 / duty - 1) before the next, so a never-dry spill on a small host takes a bounded
share of the CPU a decode needs; a caller waiting for durability (drain, close) is never
kept waiting by a rest."""

from __future__ import annotations

import time

import pytest

from foretell.cache import spill
from foretell.cache.spill import Pace, SpillQueue


class _Entry:
    tensor_bytes = 8


def _queue(duty: float, write_s: float, starts: list[float]) -> SpillQueue:
    def write(entry):
        starts.append(time.monotonic())
        time.sleep(write_s)
        return True

    return SpillQueue(write, max_bytes=1 << 20, on_done=lambda entry, outcome: None, duty=duty)


def test_a_write_is_followed_by_a_rest_in_proportion_to_it():
    pace = Pace(0.25)
    assert pace.rest() == 0.0
    pace.wrote(0.1)
    assert 0.29 < pace.rest() <= 0.3
    assert Pace(1.0).rest() == 0.0
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ValueError):
            Pace(bad)


def test_the_worker_rests_between_writes_at_its_duty():
    starts: list[float] = []
    queue = _queue(0.25, 0.05, starts)
    for _ in range(3):
        queue.submit(_Entry())
    deadline = time.monotonic() + 5
    while len(starts) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    # each gap: the 50 ms write, then a 150 ms rest
    assert len(gaps) == 2 and all(0.19 < gap < 0.6 for gap in gaps), gaps
    assert queue.close(5)


def test_waiting_for_durability_cuts_the_rests_short():
    starts: list[float] = []
    queue = _queue(0.01, 0.02, starts)  # at full pace each write would rest 2 s
    for _ in range(4):
        queue.submit(_Entry())
    begin = time.monotonic()
    assert queue.drain(5)
    assert len(starts) == 4 and time.monotonic() - begin < 1.0
    assert queue.close(5)


def test_small_hosts_pace_their_writes_and_hosts_with_cores_to_spare_do_not(monkeypatch):
    monkeypatch.setattr(spill, "parallel_reads", lambda: False)
    assert spill.default_duty() == spill.SMALL_HOST_DUTY < 1.0
    monkeypatch.setattr(spill, "parallel_reads", lambda: True)
    assert spill.default_duty() == 1.0


def test_the_duty_can_be_set_for_a_host_and_a_bad_one_is_named(monkeypatch):
    from foretell.errors import ConfigError

    monkeypatch.setenv("FORETELL_SPILL_DUTY", "0.5")
    assert spill.default_duty() == 0.5
    for bad in ("0", "2", "fast"):
        monkeypatch.setenv("FORETELL_SPILL_DUTY", bad)
        with pytest.raises(ConfigError, match="FORETELL_SPILL_DUTY"):
            spill.default_duty()
