"""Cache writes run at low CPU priority (Linux, per thread), so a spill that never runs dry
takes the CPU a decode leaves idle; reads and the caller's thread keep their priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from foretell.cache.spill import SpillQueue
from foretell.store import format as fmt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="nice is per thread only on Linux")


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_spill_worker_writes_at_the_write_niceness_and_leaves_the_caller_alone():
    caller = _niceness()
    seen = []

    def write(entry):
        seen.append(_niceness())
        return True

    queue = SpillQueue(write, max_bytes=1 << 20, on_done=lambda entry, outcome: None)
    queue.submit(_Entry())
    assert queue.close(10)
    assert seen == [max(caller, fmt.WRITE_NICENESS)]
    assert _niceness() == caller


def test_the_store_write_pool_runs_at_the_write_niceness_and_the_read_pool_does_not():
    caller = _niceness()
    assert fmt.write_pool().submit(_niceness).result() == max(caller, fmt.WRITE_NICENESS)
    assert fmt.io_pool().submit(_niceness).result() == caller


class _Entry:
    tensor_bytes = 8
