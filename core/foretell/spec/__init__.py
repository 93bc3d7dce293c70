"""Speculative decoding: the draft-source contract and the one verifier behind every drafter.

Plugins import from here: :class:`DraftProvider`, :class:`DraftSource`, :class:`Feed`,
:class:`Draft`, :class:`Target`, :class:`PairingError`, :data:`PORT_HIDDEN`,
:func:`draft_keys`.
"""

from foretell.model import PORT_MTP
from foretell.spec.contract import (
    PORT_HIDDEN,
    Draft,
    DraftError,
    DraftProvider,
    DraftSource,
    Feed,
    PairingError,
    Target,
)
from foretell.spec.verifier import (
    SpeculationStats,
    Speculator,
    draft_keys,
    make_speculator,
    speculative_steps,
)

__all__ = [
    "PORT_HIDDEN",
    "PORT_MTP",
    "Draft",
    "DraftError",
    "DraftProvider",
    "DraftSource",
    "Feed",
    "PairingError",
    "SpeculationStats",
    "Speculator",
    "Target",
    "draft_keys",
    "make_speculator",
    "speculative_steps",
]
