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

Fixed-length rounds never switch back from plain steps, and an adaptive request does: at
its first probe after a plain stretch a model drafter catches up on every plain token in one
forward (16-64 tokens). On the H200 the first adaptive request stalled right there after a
fixed-length warm-up over the same lengths (0.3-0.6 s in a host's first process), and the
8-bit demo draft's quantized matmuls for such lengths were first compiled inside a request.
So the warm-up also runs one request on a scripted policy that drafts, decodes plain
stretches of ``SWITCH_BACKS`` lengths and drafts again after each (docs/benchmarks.md, "H200:
MTP drafting up to 6, and which kernels the first request compiles"). That request runs past
the first capacity step of the fixed-shape forwards (1,024 tokens): each process's first
adaptive request also waited 40-60 ms twice at its first probe past 1,024 tokens. The
suspects, not yet told apart on the H200: the verify window tracing again for the larger
buffer, and a draft model's first single-token step over more than 1,024 keys (plain
decoding pays such a step once per process).
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

    def observe(self, drafted: int, accepted: int, seconds: float, *, one_off: bool = False) -> None:
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
    from foretell.platform import kernels

    # The draft's quantized matmuls beside the target's, started at load; the first
    # generate below waits for them all.
    kernels.precompile(speculator.provider)
    total = speculator.max_tokens + 1
    cache, engine.cache = engine.cache, None
    try:
        for k in range(1, speculator.max_tokens + 1):
            fixed = attrs.evolve(speculator, max_tokens=k, adaptive=False)
            # Sampled rounds only where this speculator speculates on sampled requests.
            samplings = (None, SamplingConfig(temp=1.0, seed=0)) if speculator.sampled else (None,)
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
