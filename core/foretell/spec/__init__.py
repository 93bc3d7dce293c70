"""Speculative decoding: the draft-source contract and the one verifier behind every drafter.

Plugins import from here: :class:`DraftProvider`, :class:`DraftSource`, :class:`Feed`,
:class:`Draft`, :class:`Target`, :class:`PairingError`, :data:`PORT_HIDDEN`,
:data:`PORT_MTP`, :data:`CATCH_UP_MAX`, :func:`draft_keys`, :class:`Drafting`; for drafters
whose state the cache stores, :class:`CheckpointableSource`, :class:`CheckpointableProvider`,
:class:`DraftState` and :func:`files_fingerprint`, :func:`resumed_keys`.

Names resolve on first use, so importing this package imports no MLX: on the CPU the BLAS
must be bound before MLX loads (docs/blas.md).
"""

from __future__ import annotations

from foretell.surface import lazy_exports

_WHERE = {
    "PORT_MTP": "foretell.model",
    "PORT_HIDDEN": "foretell.spec.contract",
    "CATCH_UP_MAX": "foretell.spec.contract",
    "Draft": "foretell.spec.contract",
    "DraftError": "foretell.spec.contract",
    "DraftProvider": "foretell.spec.contract",
    "DraftSource": "foretell.spec.contract",
    "Feed": "foretell.spec.contract",
    "PairingError": "foretell.spec.contract",
    "Target": "foretell.spec.contract",
    "CheckpointableProvider": "foretell.spec.contract",
    "CheckpointableSource": "foretell.spec.contract",
    "DraftState": "foretell.spec.contract",
    "DraftRows": "foretell.spec.rows",
    "RowDraft": "foretell.spec.rows",
    "RowStart": "foretell.spec.rows",
    "RowsProvider": "foretell.spec.rows",
    "files_fingerprint": "foretell.spec.attach",
    "resumed_keys": "foretell.spec.attach",
    "Drafting": "foretell.spec.drafting",
    "SpeculationStats": "foretell.spec.verifier",
    "Speculator": "foretell.spec.verifier",
    "draft_keys": "foretell.spec.drafting",
    "make_speculator": "foretell.spec.verifier",
}

__getattr__, __all__ = lazy_exports(__name__, _WHERE)
