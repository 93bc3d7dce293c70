"""``--draft auto``: the drafter measured best for a model on this kind of machine.

A model directory may carry ``speculation.json``, written from benchmark runs
(``foretell bench --speculation``; the shipped demo's comes from docs/benchmarks.md)::

    {"best": {"cpu": {"kind": "two-model", "options": {"model": "demo-draft"}},
              "gpu": {"kind": "mtp", "num_tokens": 6, "sampled": false}},
     "measured": "where the figures are"}

``cpu`` is chosen on MLX's CPU device, ``gpu`` on any GPU (Metal takes it until measured
there). ``"kind": "none"``: plain decoding measured best. ``num_tokens`` (optional): the
draft length that measured best (``--num-draft-tokens`` overrides it). ``"sampled": false``:
sampled requests decode plainly there. No file, no entry, or a drafter this installation
lacks: no drafter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from foretell.errors import ConfigError

FILE = "speculation.json"


def machine_kind() -> str:
    return "cpu" if mx.default_device() == mx.cpu else "gpu"


@attrs.frozen
class Measured:
    """The drafter a model's ``speculation.json`` names for this kind of machine."""

    kind: str
    options: Any = None
    #: The most tokens drafted per round that measured best; None: the engine's default.
    num_tokens: int | None = None
    #: Whether sampled requests speculate too (False: they measured faster plainly).
    sampled: bool = True


def measured_drafter(model_dir: Path | None, registry: Any) -> Measured | None:
    """The drafter for this machine from ``model_dir/speculation.json``, or None."""
    from foretell.config import MAX_DRAFT_TOKENS, make_converter, structure
    from foretell.plugin.registry import Kind
    from foretell.spec.contract import valid_draft_tokens

    if model_dir is None or not (Path(model_dir) / FILE).is_file():
        return None
    path = Path(model_dir) / FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data["best"].get(machine_kind())
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ConfigError(str(path), [f"best: cannot be read ({exc})"]) from exc
    if entry is None:
        return None
    kind = entry.get("kind")
    if kind == "none":
        return None  # plain decoding measured best on this kind of machine
    if kind not in registry.names(Kind.DRAFT):
        return None  # measured with a drafter this installation lacks (e.g. contrib n-gram)
    num_tokens = entry.get("num_tokens")
    if num_tokens is not None and not valid_draft_tokens(num_tokens):
        raise ConfigError(str(path), [f"best.{machine_kind()}.num_tokens: must be an integer "
                                      f"in 1..{MAX_DRAFT_TOKENS}, got {num_tokens!r}"])
    sampled = entry.get("sampled", True)
    if not isinstance(sampled, bool):
        raise ConfigError(str(path), [f"best.{machine_kind()}.sampled: must be true or false, "
                                      f"got {sampled!r}"])
    config = registry.get(Kind.DRAFT, kind).config
    raw = entry.get("options") or {}
    options = structure(make_converter(registry), raw, config, str(path)) if config else None
    return Measured(kind, options, num_tokens, sampled)
