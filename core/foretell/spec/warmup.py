"""Warming a speculator where the device compiles kernels per shape (MLX's CUDA backend).

MLX-CUDA compiles kernels for each new shape on first use and keeps them in a disk cache
(measured on the H200: 0.04-1 s per new verify-window length, 77 s for a fresh machine's
first MTP generation). A request that met a new draft length mid-generation paid that, and
the draft-length policy timed the stall. Warming the target's verify forward alone left the
first requests slow (n-gram on code editing: 379 tok/s, then 1,006, then 2,631), because a
round is more than that forward: the drafter's own graph at that length (a chained MTP
head, a draft model's forward), the acceptance test over ``[k + 1, V]`` scores, rejection
sampling's residual draw. So the warm-up runs whole rounds: a short generation through the
verifier at every draft length, greedy and sampled, on a throwaway copy of the speculator
(its own policy, drafting a fixed length) and with the engine's cache tier set aside, so
nothing of it is learned or stored. With the kernels already on disk it takes milliseconds
per length.
"""

from __future__ import annotations

from typing import Any

import attrs

from foretell.config import SamplingConfig

#: A prompt every drafter drafts on at any length: prompt lookup matches a repeated cycle
#: as deep as it likes; a draft model drafts on anything.
PROMPT = list(range(1, 9)) * 3


def compiles_per_shape() -> bool:
    """Whether this device compiles kernels for each new shape on first use: MLX's CUDA
    backend does (NVRTC, cached on disk)."""
    from foretell.platform.device import on_cuda

    return on_cuda()


def warm_up(engine: Any, speculator: Any) -> None:
    """Where the device compiles per shape, run a few rounds of every draft length
    ``1..speculator.max_tokens`` through ``engine``'s verifier, greedy and sampled;
    ``speculator`` itself is left untouched. Elsewhere, nothing."""
    if not compiles_per_shape():
        return
    cache, engine.cache = engine.cache, None
    try:
        for k in range(1, speculator.max_tokens + 1):
            fixed = attrs.evolve(speculator, max_tokens=k, adaptive=False)
            for sampling in (None, SamplingConfig(temp=1.0, seed=0)):
                for _event in engine.generate(PROMPT, max_tokens=2 * (k + 1), sampling=sampling,
                                              speculate=fixed, ignore_eos=True, chat=False):
                    pass
    finally:
        engine.cache = cache
