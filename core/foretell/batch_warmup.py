"""Warming a scheduler's batch shapes where the device compiles per shape (MLX's CUDA backend).

A batch meets a new shape each time its row count changes, and MLX-CUDA compiles kernels (and
builds a CUDA graph) for a shape on its first use: on the H100 a first step over 8 rows took
148 ms against 1.6 ms after (docs/decisions.md, "Warming batch shapes"), paid by every request
of the first burst that reached 8 rows. ``foretell serve`` runs each row count once before it
listens, with the cache tier set aside so nothing is stored, and gives the scheduler a fresh
batch policy after, so what it learned from compiling steps does not steer the first requests.
Elsewhere (CPUs, Metal), nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from foretell.spec.warmup import compiles_per_shape

#: Each warm-up request's prompt: long enough to decode past, short enough to cost nothing.
PROMPT = list(range(1, 17))
#: Tokens each warm-up request decodes: its first (a plain step) and pipelined steps after.
TOKENS = 4


def warm_batches(scheduler: Any, rows: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> int:
    """Where the device compiles per shape, decode ``1..rows`` requests at once (default the
    scheduler's ``max_rows``) through ``scheduler``; ``progress(done, total)`` hears of each
    row count. Returns the row counts run (0 where the device does not compile per shape)."""
    if not compiles_per_shape():
        return 0
    from foretell.spec.batch_policy import BatchDraftPolicy
    from foretell.stream import merged

    top = scheduler.max_rows if rows is None else min(rows, scheduler.max_rows)
    engine = scheduler.engine
    cache, engine.cache = engine.cache, None
    try:
        for count in range(1, top + 1):
            handles = [scheduler.submit(PROMPT, max_tokens=TOKENS, ignore_eos=True, chat=False,
                                        speculate=False) for _ in range(count)]
            for _ in merged(handles):
                pass
            if progress is not None:
                progress(count, top)
    finally:
        engine.cache = cache
    scheduler.reset_policy(BatchDraftPolicy())
    return top
