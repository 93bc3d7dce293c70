"""An mlx-lm model as a :class:`foretell.model.Model`.

The built object *is* mlx-lm's ``Model`` (its class gains :class:`Adapted` as a mixin), so
its parameter names are the checkpoint's and foretell's loader checks and loads them as for
any architecture; mlx-lm's ``sanitize`` maps checkpoint quirks.

mlx-lm models return logits; foretell's contract splits a forward into ``forward`` (the
hidden states the head consumes) and ``logits``. The split is made at the *backbone*, the
submodule that owns the decoder layers: ``forward`` runs mlx-lm's own ``__call__`` and stops
it where the backbone returns; ``logits`` runs the same ``__call__`` with the backbone
handing back the given states, so every head detail (tied embeddings, soft-capping, logit
scales) is mlx-lm's own code. For the families with a final norm inside the backbone (nearly
all), ``forward``'s states are the final-normed ones hidden-state drafters read.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from foretell_mlxlm.batch import BatchLayer, batch_caches
from foretell_mlxlm.caches import Journal, adapt
from foretell_mlxlm.zoo import REMAPPED

#: Where mlx-lm keeps the part of a model that returns hidden states, in the order tried.
BACKBONES = ("model", "backbone", "transformer", "language_model", "llm")
#: What a backbone calls its decoder layers.
LAYER_LISTS = ("layers", "h", "blocks")


class _Stop(Exception):
    """Ends a run of mlx-lm's ``__call__`` where the hooked module returned."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Hook:
    """What a hooked module does when called: stop with its output, or return a given one."""

    __slots__ = ("stop", "give", "take_input")

    def __init__(self) -> None:
        self.stop = False
        self.take_input = False
        self.give: Any = None


_HOOKED: dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    found = _HOOKED.get(cls)
    if found is None:
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            hook = self._foretell_hook
            if hook.give is not None:
                return hook.give
            if hook.take_input:
                raise _Stop(args[0] if args else next(iter(kwargs.values())))
            out = cls.__call__(self, *args, **kwargs)
            if hook.stop:
                raise _Stop(out)
            return out

        found = _HOOKED[cls] = type(cls.__name__, (cls,), {"__call__": __call__,
                                                          "__module__": cls.__module__})
    return found


def _hook(module: nn.Module) -> _Hook:
    module.__class__ = _hooked_class(type(module))
    hook = _Hook()
    object.__setattr__(module, "_foretell_hook", hook)
    return hook


def find_backbone(model: nn.Module) -> nn.Module:
    """The submodule whose output the head consumes: the first of :data:`BACKBONES` down
    from ``model``, past wrappers that are themselves whole models (a VLM's language
    model)."""
    node = model
    while True:
        child = next((node[name] for name in BACKBONES
                      if isinstance(node.get(name), nn.Module)), None)
        if child is None:
            if node is model:
                raise ValueError(f"{type(model).__module__}: no backbone found among "
                                 f"{', '.join(BACKBONES)}")
            return node
        if not _is_whole_model(child):
            return child
        node = child


def _is_whole_model(module: nn.Module) -> bool:
    """A module that itself ends in a head (a wrapped text model) rather than a backbone."""
    return type(module).__name__ == "Model" or "lm_head" in module


class Adapted:
    """The foretell side of an adapted mlx-lm model (mixed in before its class)."""

    #: No taps or MTP head: only the ports every Model offers (hidden states, embed, logits).
    capabilities: frozenset[str] = frozenset()

    def _adapt(self, config: dict[str, Any]) -> None:
        object.__setattr__(self, "model_type", config["model_type"])
        object.__setattr__(self, "vocab_size", _vocab_size(config))
        backbone = find_backbone(self)
        object.__setattr__(self, "_backbone_hook", _hook(backbone))
        layers = next((backbone[n] for n in LAYER_LISTS
                       if isinstance(backbone.get(n), list) and backbone[n]), None)
        first = layers[0] if layers is not None else None
        object.__setattr__(self, "_first_layer_hook",
                           _hook(first) if isinstance(first, nn.Module) else None)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        own = getattr(super(), "sanitize", None)
        return own(weights) if own is not None else weights

    def make_caches(self) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        return adapt(make_prompt_cache(self))

    def make_batch_caches(self, *, bits: int | None = None, group_size: int = 64) -> list[Any]:
        """Batch caches over mlx-lm's own (:mod:`foretell_mlxlm.batch`). ``bits`` and
        ``group_size`` are not used: an adapted model's single caches are never quantized
        either, and a batch holds what they hold."""
        return batch_caches(self)

    def _run(self, hook: _Hook, tokens: mx.array, caches: Any) -> Any:
        hook.stop = True
        try:
            self(tokens, cache=caches)
        except _Stop as stopped:
            return stopped.value
        finally:
            hook.stop = False
        raise RuntimeError(f"{self.model_type}: mlx-lm's forward never reached its backbone")

    def forward(self, tokens: mx.array, caches: list[Any] | None = None,
                taps: Sequence[int] = ()) -> tuple[mx.array, dict[int, mx.array]]:
        if taps:
            raise ValueError(f"{self.model_type} (mlx-lm adapter) offers no layer taps")
        if caches and isinstance(caches[0], BatchLayer):
            hidden = self._run(self._backbone_hook, tokens, [c.cache for c in caches])
            for cache in caches:
                cache.took(tokens.shape[1])
            return hidden, {}
        journal = Journal.of(self, caches) if caches is not None else None
        if journal is not None:
            journal.record(tokens)
        hidden = self._run(self._backbone_hook, tokens, caches)
        for cache in caches or ():
            if cache.counted:
                cache._seen += tokens.shape[1]
            elif getattr(cache, "keys", False) is None:
                # A KV cache its layer never writes (attention replaced by a linear map)
                # still counts the tokens, so every cache of a sequence agrees on its length
                # (checkpoints and the prefix cache require that).
                cache.offset += tokens.shape[1]
        return hidden, {}

    def logits(self, hidden: mx.array) -> mx.array:
        hook = self._backbone_hook
        hook.give = hidden
        try:
            return self(mx.zeros(hidden.shape[:2], dtype=mx.int32), cache=None)
        finally:
            hook.give = None

    def embed(self, tokens: mx.array) -> mx.array:
        """What the first decoder layer receives for ``tokens`` (scaled where the
        architecture scales it)."""
        if self._first_layer_hook is None:
            raise ValueError(f"{self.model_type} (mlx-lm adapter): no decoder layers found "
                             "to read the input embedding at")
        hook = self._first_layer_hook
        hook.take_input = True
        try:
            self(tokens, cache=None)
        except _Stop as stopped:
            return stopped.value
        finally:
            hook.take_input = False
        raise RuntimeError(f"{self.model_type}: mlx-lm's forward never reached a layer")


def _vocab_size(config: dict[str, Any]) -> int:
    for section in (config, config.get("text_config") or {}, config.get("llm_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return section["vocab_size"]
    raise ValueError("field 'vocab_size': missing (nor in text_config)")


_ADAPTED: dict[type, type] = {}


def build(config: dict[str, Any]) -> Any:
    """An adapted mlx-lm model for ``config`` (a parsed config.json); weights unloaded."""
    model_type = config["model_type"]
    module_name = REMAPPED.get(model_type, model_type)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            module = importlib.import_module(f"mlx_lm.models.{module_name}")
    except ImportError as exc:
        raise ValueError(f"field 'model_type': mlx-lm has no module for '{model_type}' "
                         f"({exc})") from exc
    except SystemExit as exc:
        # A module that needs a package it lacks prints how to install it and exits; a
        # foretell run must fail as for any other unusable model instead.
        raise ValueError(f"field 'model_type': mlx-lm's models/{module_name}.py cannot "
                         f"load: {said.getvalue().strip() or exc}") from None
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    cls = type(model)
    adapted = _ADAPTED.get(cls)
    if adapted is None:
        adapted = _ADAPTED[cls] = type(f"Adapted{cls.__name__}", (Adapted, cls),
                                       {"__module__": __name__})
    model.__class__ = adapted
    model._adapt(config)
    return model
