"""mlx-lm's caches under foretell's cache contract, and the codec that stores them.

An adapted model's caches are mlx-lm's own objects (its module code calls their
``update_and_fetch``, ``make_mask``, ``cache[0]``), given the few things foretell asks of a
cache by a mixin: an ``offset`` on every kind (a recurrent state counts the tokens it took
in), ``stays_trimmable`` and a ``trim`` that is always exact.

Rolling back: a sequence whose caches are all plain ``KVCache`` trims them directly. A
sequence with any other kind (a recurrent ``ArraysCache``, a sliding ring that may wrap, a
chunked cache) is *journaled*: before every forward each cache's state is kept (views of its
arrays: MLX arrays are values, so nothing is copied), and a rollback of ``n`` tokens puts
every cache back and feeds the forward's first ``L - n`` tokens again. Speculation on a
hybrid model therefore keeps exactly the accepted prefix, at the cost of one more forward of
the kept tokens on a round with a rejection (docs/decisions.md, "mlx-lm adapter").
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as lm

from foretell.errors import CodecError, GenerationError


def _view(tree: Any) -> Any:
    """``tree`` with every array replaced by a new array object over the same buffer: a
    cache's in-place write (``keys[..., a:b, :] = x``) changes its own object only."""
    if isinstance(tree, mx.array):
        return tree[...]
    if isinstance(tree, (list, tuple)):
        return type(tree)(_view(x) for x in tree)
    return tree


class AdaptedCache:
    """What foretell adds to an mlx-lm cache (mixed in before its class)."""

    #: Rolled back by the sequence's :class:`Journal` (True) or trimmed directly.
    journaled = False
    #: The kind keeps no ``offset`` of its own; :attr:`offset` counts what it took in.
    counted = False
    _journal: Journal | None = None
    _seen = 0

    @property
    def state(self) -> tuple[mx.array, ...]:
        """foretell's view of the state: its arrays (a ``KVCache``'s up to its offset), what
        prefill evaluates and byte counts read. mlx-lm's own form: :func:`lm_state`."""
        if base_class(self) is lm.KVCache:
            if self.keys is None:
                return ()
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return tuple(flat_arrays(lm_state(self)))

    @state.setter
    def state(self, value: Any) -> None:
        _state_property(type(self)).fset(self, value)

    def stays_trimmable(self, n: int) -> bool:
        return True

    def is_trimmable(self) -> bool:
        if self.journaled and self._journal is not None and self._journal.covers(self):
            return True
        return self._natively_trimmable()

    def _natively_trimmable(self) -> bool:
        return hasattr(super(), "trim") and super().is_trimmable()

    def trim(self, n: int) -> int:
        if self.journaled and self._journal is not None and self._journal.covers(self):
            return self._journal.undo(self, n)
        if not self._natively_trimmable():
            raise GenerationError(f"an mlx-lm {type(self).__name__} cannot drop its last {n} "
                             "tokens: only the last forward's tokens can be rolled back")
        return super().trim(n)


def _state_property(cls: type) -> property:
    return next(vars(k)["state"] for k in cls.__mro__
                if k.__module__.startswith("mlx_lm.") and "state" in vars(k))


def lm_state(cache: Any) -> Any:
    """mlx-lm's own ``state`` of an adapted cache (what its ``from_state`` takes back)."""
    return _state_property(type(cache)).fget(cache)


def flat_arrays(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [a for x in tree for a in flat_arrays(x)]
    return []


class _Counted:
    """``offset`` for mlx-lm kinds without one (recurrent state, cache lists)."""

    @property
    def offset(self) -> int:
        return self._seen

    @offset.setter
    def offset(self, value: int) -> None:
        self._seen = value


_CLASSES: dict[tuple[type, bool], type] = {}


def adapted_class(base: type, journaled: bool) -> type:
    """The adapted subclass of mlx-lm cache class ``base`` (one per base and mode)."""
    key = (base, journaled)
    found = _CLASSES.get(key)
    if found is None:
        counted = not any("offset" in vars(k) for k in base.__mro__) and not _sets_offset(base)
        bases = (AdaptedCache, _Counted, base) if counted else (AdaptedCache, base)
        found = _CLASSES[key] = type(f"MlxLm{base.__name__}", bases, {
            "journaled": journaled, "counted": counted, "__module__": __name__})
    return found


def _sets_offset(base: type) -> bool:
    """Whether ``base``'s constructor sets ``self.offset`` (mlx-lm's KV kinds do)."""
    init = getattr(base, "__init__", None)
    code = getattr(init, "__code__", None)
    return code is not None and "offset" in code.co_names


def adapt(caches: list[Any]) -> list[Any]:
    """mlx-lm caches of one sequence, adapted in place (their class gains the mixin); the
    sequence is journaled unless every cache is a plain ``KVCache``."""
    journaled = any(type(c) is not lm.KVCache for c in caches)
    for cache in caches:
        cache.__class__ = adapted_class(type(cache), journaled)
    return caches


def base_class(cache: Any) -> type:
    """The mlx-lm class an adapted cache extends."""
    return next(k for k in type(cache).__mro__ if k.__module__.startswith("mlx_lm."))


#: Forwards a journal can undo: a verify window is one; a draft model drafting k tokens
#: one forward each rolls back across k (at most 16, ``DraftConfig.num_tokens``' cap).
HISTORY = 24


class Journal:
    """One sequence's undo record: for each of its last :data:`HISTORY` forwards, the
    tokens it took in and every cache as it was before (an offset for a ``KVCache``, which
    trims exactly; views of the state of any other kind)."""

    def __init__(self, model: Any, caches: list[Any]) -> None:
        self.model, self.caches = model, caches
        self.history: list[tuple[mx.array, list[Any]]] = []
        self.heard: set[int] = set()
        for cache in caches:
            cache._journal = self

    @classmethod
    def of(cls, model: Any, caches: list[Any]) -> Journal | None:
        """The journal of ``caches`` (a new one when they are not all under one yet), or
        None for a sequence trimmed directly."""
        if not caches or not getattr(caches[0], "journaled", False):
            return None
        journal = caches[0]._journal
        if journal is None or journal.caches is not caches or any(
                c._journal is not journal for c in caches):
            journal = cls(model, caches)
        return journal

    def record(self, tokens: mx.array) -> None:
        # A KVCache's old buffers are not held: holding them would make its next in-place
        # write copy the whole buffer.
        before = [c.offset if base_class(c) is lm.KVCache else (_view(lm_state(c)), c._seen)
                  for c in self.caches]
        self.history = [*self.history[1 - HISTORY:], (tokens, before)]
        self.heard = set()

    def covers(self, cache: Any) -> bool:
        return bool(self.history)

    def undo(self, cache: Any, n: int) -> int:
        """Drop the newest ``n`` tokens from every cache; the first call of a ``trim`` over
        the sequence does it, its calls on the other caches return."""
        if self.heard and id(cache) not in self.heard:
            self.heard.add(id(cache))
            return n
        self.heard = {id(cache)}
        if not n:
            return 0
        first, taken = len(self.history), 0
        while taken < n and first:
            first -= 1
            taken += self.history[first][0].shape[1]
        if taken < n:
            raise GenerationError(f"cannot roll back {n} tokens: the journal of the last "
                                  f"{HISTORY} forwards holds {taken}, and a recurrent state "
                                  "keeps no older history")
        replay = mx.concatenate([t for t, _ in self.history[first:]], axis=1)[:, : taken - n]
        for c, was in zip(self.caches, self.history[first][1]):
            if isinstance(was, int):
                super(AdaptedCache, c).trim(c.offset - was)
            else:
                c.state, c._seen = _view(was[0]), was[1]
        del self.history[first:]
        if replay.shape[1]:
            self.model.forward(replay, self.caches)  # journaled again, as one forward
        self.heard = {id(cache)}
        return n


class MlxLmCacheCodec:
    """Stores any adapted mlx-lm cache: its ``state`` tree (arrays as tensors, the rest as
    JSON meta) and which mlx-lm class it is; a ``KVCache`` is stored up to its offset only."""

    name = "mlx-lm"

    def __init__(self) -> None:
        import mlx_lm

        # mlx-lm's state layout is its own: another version's entries are never read.
        self.provider_id = f"foretell-mlxlm/mlx-lm-{mlx_lm.__version__}@1"

    def matches(self, cache: Any) -> bool:
        return isinstance(cache, AdaptedCache)

    def snapshot(self, cache: Any) -> tuple[dict[str, mx.array], dict[str, Any]]:
        base = base_class(cache)
        state = lm_state(cache)
        if base is lm.KVCache and cache.keys is not None:
            state = (cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :],
                     cache.offset)
        tensors: dict[str, mx.array] = {}
        tree = _encode(state, tensors)
        meta = {"class": f"{base.__module__}:{base.__qualname__}", "tree": tree,
                "journaled": type(cache).journaled, "offset": int(cache.offset)}
        if base is lm.RotatingKVCache:
            meta["max_size"] = int(cache.max_size)
        return tensors, meta

    def load(self, tensors: Mapping[str, mx.array], meta: Mapping[str, Any]) -> Any:
        module, _, name = str(meta["class"]).partition(":")
        if not module.startswith("mlx_lm."):
            raise CodecError(f"codec 'mlx-lm': {meta['class']} is no mlx-lm cache class")
        try:
            base = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise CodecError(f"codec 'mlx-lm': cannot find cache class {meta['class']}") from exc
        cls = adapted_class(base, bool(meta["journaled"]))
        cache = cls.__new__(cls)
        cache.state = _decode(meta["tree"], tensors)
        if cls.counted:
            cache._seen = int(meta["offset"])
        return cache

    def clone(self, cache: Any) -> Any:
        return self.load(*self.snapshot(cache))

    def header_trimmable(self, meta: Mapping[str, Any]) -> bool:
        kind = str(meta["class"]).rpartition(":")[2]
        if kind in ("KVCache", "ChunkedKVCache", "ConcatenateKVCache"):
            return True
        if kind == "RotatingKVCache":
            return int(meta["offset"]) < int(meta["max_size"])
        return False  # recurrent state: only its exact length can be served

    def minimum_reusable_offset(self, meta: Mapping[str, Any]) -> int:
        return 0 if self.header_trimmable(meta) else int(meta["offset"])


def _encode(tree: Any, tensors: dict[str, mx.array]) -> Any:
    if isinstance(tree, mx.array):
        name = f"t{len(tensors)}"
        tensors[name] = tree
        return {"tensor": name}
    if isinstance(tree, (list, tuple)):
        return {"list" if isinstance(tree, list) else "tuple": [_encode(x, tensors) for x in tree]}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"value": tree}
    raise CodecError(f"codec 'mlx-lm': cannot store a {type(tree).__name__} in a cache state")


def _decode(tree: Mapping[str, Any], tensors: Mapping[str, mx.array]) -> Any:
    if "tensor" in tree:
        return tensors[tree["tensor"]][...]
    if "list" in tree:
        return [_decode(x, tensors) for x in tree["list"]]
    if "tuple" in tree:
        return tuple(_decode(x, tensors) for x in tree["tuple"])
    return tree["value"]
