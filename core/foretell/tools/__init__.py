"""Tooling around the engine, not the engine: what ``foretell bench`` runs, and synthetic models.
It measures, never serves; nothing in the engine imports it.

- :mod:`foretell.tools.bench`: ``foretell bench``, foretell against mlx-lm in one run;
  :mod:`foretell.tools.bench_spec` its speculation rows (``--speculation``),
  :mod:`foretell.tools.bench_cache` its prefix-cache rows (``--cache``), each phase in a
  process of its own (:mod:`foretell.tools.bench_cache_phases`);
- :mod:`foretell.tools.measure`: what every bench shares (the clock, the machine's
  description, prompts, portable JSON), also used by the scripts in ``benchmarks/``;
- :mod:`foretell.tools.synthetic`: random-weight model directories of any installed
  architecture that registers a :class:`SyntheticSpec`.

Plugin authors import from here: :class:`SyntheticSpec`, :data:`TOKENIZER_VOCAB`,
:func:`make_model_dir`, :func:`make_preset_dir`. Names resolve on first use, so importing
this package imports no MLX.
"""

from __future__ import annotations

from foretell.surface import lazy_exports

_WHERE = {
    "SyntheticSpec": "foretell.tools.synthetic",
    "TOKENIZER_VOCAB": "foretell.tools.synthetic",
    "make_model_dir": "foretell.tools.synthetic",
    "make_preset_dir": "foretell.tools.synthetic",
}

__getattr__, __all__ = lazy_exports(__name__, _WHERE)
