"""Warming a speculator where the device compiles kernels per shape (MLX's CUDA backend).

MLX-CUDA compiles kernels for each new shape on first use, and a request that met a new
draft length mid-generation paid that while the draft-length policy timed the stall. A round
is more than the target's verify forward (the drafter's graph, the acceptance test, the
residual draw), so the warm-up runs whole rounds: a short generation at every draft length,
greedy and sampled, on a throwaway copy of the speculator with the cache tier set aside, so
nothing is learned or stored. It also runs one request on a scripted policy that decodes
plain stretches of ``SWITCH_BACKS`` lengths and drafts again after each, past the first
fixed-shape capacity step: the catch-up shapes an adaptive request's first probe makes,
which no fixed-length round does (figures: docs/decisions.md).
"""

from __future__ import annotations

from typing import Any

import attrs

from foretell.config import SamplingConfig
from foretell.model.fixed import CAPACITY_STEP
from foretell.spec.policy import PLAIN_STRETCH, DraftLengthPolicy

#: A prompt every drafter drafts on at any length: prompt lookup matches a repeated cycle
#: as deep as it likes; a draft model drafts on anything.
PROMPT = list(range(1, 9)) * 3
#: Plain stretches (of ``PLAIN_STRETCH`` steps each) the scripted request decodes before
#: each switch back to drafting: catch-up forwards of about 16, 32 and 64 tokens.
SWITCH_BACKS = (2, 4, 8)
#: The scripted request's prompt: past the fixed-shape forwards' first capacity step.
LONG_PROMPT = list(range(1, 9)) * ((CAPACITY_STEP + 16) // 8)


class ScriptedPolicy(DraftLengthPolicy):
    """Chooses the draft lengths of ``script`` in turn (then ``max_k``) and learns nothing."""

    def __init__(self, max_k: int, script: list[int]):
        super().__init__(max_k, adaptive=False)
        self.script = list(script)

    def choose(self, limit: int) -> int:
        k = self.script.pop(0) if self.script else self.max_k
        return max(0, min(k, limit, self.max_k))

    def observe(self, drafted: int, accepted: int, seconds: float, *, one_off: bool = False,
                fed: bool = False) -> None:
        pass


def switch_back_script(k: int) -> tuple[list[int], int]:
    """A script that drafts ``k`` twice, then decodes each of ``SWITCH_BACKS`` plain
    stretches and drafts twice after it; and the tokens that takes at most."""
    script = [k, k]
    for stretches in SWITCH_BACKS:
        script += [0] * stretches + [k, k]
    return script, 2 * (k + 1) * (len(SWITCH_BACKS) + 1) + PLAIN_STRETCH * sum(SWITCH_BACKS)


def compiles_per_shape() -> bool:
    """Whether this device compiles kernels for each new shape on first use: MLX's CUDA
    backend does (NVRTC, cached on disk)."""
    from foretell.platform.device import on_cuda

    return on_cuda()


def warm_up(engine: Any, speculator: Any, progress: Any = None) -> None:
    """Where the device compiles per shape, run a few rounds of every draft length
    ``1..speculator.max_tokens`` through ``engine``'s verifier, greedy and sampled, then the
    switch-backs; ``speculator`` itself is left untouched, and ``progress(done, total)``
    hears of each step. Elsewhere, nothing."""
    if not compiles_per_shape():
        return
    from foretell.platform import device

    # The draft's quantized matmuls beside the target's, started at load; the first
    # generate below waits for them all.
    cuda = device.cuda_backend()
    if cuda is not None:
        cuda.kernels.precompile(speculator.provider)
    total = speculator.max_tokens + 1
    cache, engine.cache = engine.cache, None
    try:
        for k in range(1, speculator.max_tokens + 1):
            fixed = attrs.evolve(speculator, max_tokens=k, adaptive=False)
            # Sampled rounds only where this speculator speculates on sampled requests: an
            # unseeded one (rejection sampling) and a seeded one (token-match, position keys).
            samplings = (None,)
            if speculator.sampled:
                samplings += (SamplingConfig(temp=1.0), SamplingConfig(temp=1.0, seed=0))
            for sampling in samplings:
                for _event in engine.generate(PROMPT, max_tokens=2 * (k + 1), sampling=sampling,
                                              speculate=fixed, ignore_eos=True, chat=False):
                    pass
            if progress is not None:
                progress(k, total)
        switch_backs(engine, speculator)
        if progress is not None:
            progress(total, total)
    finally:
        engine.cache = cache


def switch_backs(engine: Any, speculator: Any) -> None:
    """One greedy request on a scripted copy of ``speculator`` over :data:`LONG_PROMPT`:
    plain stretches, each followed by a switch back to drafting ``speculator.max_tokens``."""
    scripted = attrs.evolve(speculator, adaptive=False)
    script, tokens = switch_back_script(speculator.max_tokens)
    # A speculator is frozen and makes its own policy; this throwaway copy gets the script.
    object.__setattr__(scripted, "policy", ScriptedPolicy(speculator.max_tokens, script))
    for _event in engine.generate(LONG_PROMPT, max_tokens=tokens, speculate=scripted,
                                  ignore_eos=True, chat=False):
        pass
