"""Warming a scheduler's batch shapes where the device compiles per shape (MLX's CUDA backend).

A batch meets a new shape each time its row count changes, and MLX-CUDA compiles kernels (and
builds a CUDA graph) for a shape on its first use: on the H100 a first step over 8 rows took
130 ms, and over 17, against 3-5 ms met again; the first step over rows of different lengths
(whose cache writes are other kernels) 8.7 s on a fresh host (docs/decisions.md, "Warming
batch shapes"), each paid by every request of the first burst that met it. ``foretell serve``
runs each row count once before it listens, its rows in step and then of different lengths,
with the cache tier set aside so nothing is stored, and gives the scheduler a fresh batch
policy after, so what it learned from compiling steps does not steer the first requests.
Elsewhere (CPUs, Metal), nothing.
"""

from __future__ import annotations

from typing import Any

from foretell.spec.warmup import compiles_per_shape

#: Each warm-up request's prompt: long enough to decode past, short enough to cost nothing.
PROMPT = list(range(1, 17))
#: Tokens each warm-up request decodes: its first (a plain step) and pipelined steps after.
TOKENS = 4


def warm_batches(scheduler: Any) -> int:
    """Where the device compiles per shape, decode ``1..max_rows`` requests at once through
    ``scheduler``. Returns the row counts run (0 where the device does not compile per shape)."""
    if not compiles_per_shape():
        return 0
    from foretell.stream import merged

    top = scheduler.max_rows
    engine = scheduler.engine
    cache, engine.cache = engine.cache, None
    try:
        for count in range(1, top + 1):
            # Rows in step, then rows of different lengths (a ragged batch's cache writes
            # are other kernels: its first step over 4 rows took 8.7 s on the H100).
            for ragged in (False, True) if count > 1 else (False,):
                handles = [scheduler.submit(PROMPT[:len(PROMPT) - (i % 3 if ragged else 0)],
                                            max_tokens=TOKENS, ignore_eos=True, chat=False,
                                            speculate=False) for i in range(count)]
                for _ in merged(handles):
                    pass
    finally:
        engine.cache = cache
    scheduler.reset_policy()
    return top
