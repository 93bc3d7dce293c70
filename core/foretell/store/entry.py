"""What a storage layout stores: one cache entry, its header, and whose it is.

Shared by every layout (the single-file layout in core, the segmented block store plugin)
so the SSD tier above them never depends on how bytes sit on disk. Importing this module
must stay cheap: layouts are imported when plugins register, so no mlx here at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from array import array
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import xxhash

from foretell.errors import StoreError

if TYPE_CHECKING:
    import mlx.core as mx

# Directory names are built from these; anything else could escape the cache root.
_PATH_SAFE = re.compile(r"^[A-Za-z0-9._-]+$")


def _path_safe(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    if not _PATH_SAFE.match(value) or value in (".", ".."):
        raise ValueError(
            f"{attribute.name}: must be letters, digits, '.', '_' or '-' (it names a "
            f"directory), got {value!r}"
        )


@attrs.frozen(kw_only=True)
class StoreIdentity:
    """Whose cache entries a store serves. Cache identity is total (DESIGN.md invariant 7).

    ``model_fingerprint`` and ``kv_scheme`` name the directory entries live in; the rest is
    recorded in every entry and checked on scan and read, so a file written for another
    model, tokenizer or codec is never served.
    """

    model_fingerprint: str = attrs.field(validator=_path_safe)
    kv_scheme: str = attrs.field(default="plain", validator=_path_safe)
    model_id: str
    tokenizer_hash: str
    #: Codec provider ids this process can load (``Codec.provider_id`` of each codec).
    codec_providers: frozenset[str] = attrs.field(converter=frozenset)

    @property
    def directory(self) -> str:
        return f"{self.model_fingerprint}-{self.kv_scheme}"

    @classmethod
    def for_model_dir(
        cls,
        model_dir: str | Path,
        *,
        model_id: str,
        codec_providers: Sequence[str],
        kv_scheme: str = "plain",
    ) -> StoreIdentity:
        """The identity of the model in ``model_dir``: the fingerprint of its ``config.json``
        and weights (:func:`model_fingerprint`) and the digest of its ``tokenizer.json``.

        :raises StoreError: a weights file is not safetensors (naming it).
        """
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        return cls(
            model_fingerprint=model_fingerprint(config, weights_digest(model_dir)),
            kv_scheme=kv_scheme,
            model_id=model_id,
            tokenizer_hash=hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()[:32],
            codec_providers=codec_providers,
        )


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """16 hex digits naming a model configuration; key order and whitespace do not matter."""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def model_fingerprint(config: Mapping[str, Any], weights: str) -> str:
    """16 hex digits naming a model: its configuration and its weights' digest
    (:func:`weights_digest`). Two fine-tunes of one base share a config and a tokenizer,
    and often a directory name (``mlx_model``); their KV must never be served for each
    other."""
    return hashlib.sha256(f"{config_fingerprint(config)}:{weights}".encode()).hexdigest()[:16]


#: Bytes of each tensor :func:`weights_digest` reads at its start, its middle and its end.
WEIGHT_SAMPLE_BYTES = 4096


def weights_digest(model_dir: str | Path) -> str:
    """32 hex digits naming the weights in ``model_dir``: :func:`files_digest` of its
    ``*.safetensors`` files.

    :raises StoreError: a file is not safetensors (naming it).
    """
    return files_digest(Path(model_dir).glob("*.safetensors"))


def files_digest(paths: Iterable[str | Path]) -> str:
    """32 hex digits naming the contents of ``paths`` (in name order): XXH3-128 over each
    file's name and size and, of a ``*.safetensors`` file, its header (every tensor's name,
    dtype, shape and offsets) and, of every tensor, its first, middle and last
    :data:`WEIGHT_SAMPLE_BYTES` bytes; of any other file (a ``config.json``), every byte.
    Sampled, a weights file costs ~12 KiB a tensor (a few MB for a 4B model) instead of all
    of it at every start: training changes every byte of a tensor it touches, so a
    fine-tune gets another digest; a change confined to bytes no sample covers goes unseen
    (the digest tells models apart, it does not resist an adversary).

    :raises StoreError: a ``.safetensors`` file is not safetensors (naming it).
    """
    state = xxhash.xxh3_128()
    for path in sorted(Path(p) for p in paths):
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if path.suffix == ".safetensors":
                _sampled(path, fh, size, state)
                continue
            state.update(f"{path.name}:{size}:".encode())
            while chunk := fh.read(1 << 22):
                state.update(chunk)
    return state.hexdigest()


def _sampled(path: Path, fh: Any, size: int, state: Any) -> None:
    """Feed ``state`` a safetensors file's name, size, header and tensor samples."""
    raw = fh.read(8)
    length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 2 <= length <= size - 8:
        raise StoreError(f"{path}: not a safetensors file (header length {length})")
    header = fh.read(length)
    try:
        index = json.loads(header)
        spans = sorted(tuple(t["data_offsets"]) for name, t in index.items()
                       if name != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StoreError(f"{path}: not a safetensors header ({exc})") from None
    state.update(f"{path.name}:{size}:".encode())
    state.update(header)
    for begin, end in spans:
        for at in _samples(8 + length + begin, 8 + length + end):
            state.update(os.pread(fh.fileno(), WEIGHT_SAMPLE_BYTES, at)
                         [: min(WEIGHT_SAMPLE_BYTES, 8 + length + end - at)])


def _samples(begin: int, end: int) -> list[int]:
    """Where a tensor's samples start: its first, middle and last bytes (fewer samples
    where they would overlap)."""
    n = WEIGHT_SAMPLE_BYTES
    if end - begin <= 3 * n:
        return list(range(begin, end, n))
    return [begin, begin + (end - begin - n) // 2, end - n]


@attrs.frozen(kw_only=True)
class LayerState:
    """One layer's cache as its codec snapshotted it (see :mod:`foretell.cache.codecs`)."""

    codec: str
    provider: str
    #: Small JSON-able facts the codec needs to rebuild the cache (offset, ring index...).
    meta: Mapping[str, Any]
    #: Only the valid prefix; MLX arrays are immutable values, so these may be shared.
    tensors: Mapping[str, mx.array]


@attrs.frozen(kw_only=True)
class Entry:
    """The KV state after feeding ``tokens``: what a layout writes and reads back."""

    tokens: tuple[int, ...] = attrs.field(converter=tuple)
    layers: tuple[LayerState, ...] = attrs.field(converter=tuple)
    #: Entries only serve prompts of the same namespace (e.g. a LoRA adapter's identity).
    namespace: str = ""
    #: Device digests of the tensors by (layer index, tensor name), computed where they live
    #: before a write (:func:`foretell.store.digest.attach`); a layout may record them so a
    #: reader on that device checks what landed there. Empty: none were computed.
    digests: Mapping[tuple[int, str], int] = attrs.field(factory=dict, eq=False)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.tensors.values())


#: One layer's form as a model's caches give it: each tensor's name, dtype and shape, the
#: token axis (the second-to-last, along which the block store cuts too) as -1, by name.
LayerForm = tuple[tuple[str, str, tuple[int, ...]], ...]


def layer_form(tensors: Mapping[str, Any]) -> LayerForm:
    """The form of one layer's tensors (anything with a ``dtype`` and a ``shape``)."""
    return tuple(sorted(
        (name, str(t.dtype).rsplit(".", 1)[-1],
         tuple(-1 if axis == len(t.shape) - 2 else size for axis, size in enumerate(t.shape)))
        for name, t in tensors.items()))


def form_mismatch(layers: Sequence[LayerState], model: Sequence[LayerForm]) -> str | None:
    """Why an entry's layers are not what the model's caches hold (None: they are): fewer
    layers than the model has, or one whose tensors' names, dtypes or shapes (the token
    count aside) differ. A checksum cannot tell: an entry re-signed with a layer removed,
    or float32 relabelled int32, passes every one. Layers past the model's (a drafter's
    attachment, a generation checkpoint's mark) are for their readers to check."""
    return forms_differ([layer_form(layer.tensors) for layer in layers], model)


def forms_differ(found: Sequence[LayerForm], model: Sequence[LayerForm]) -> str | None:
    """Why layers of the forms ``found`` are not what the model's caches hold, as
    :func:`form_mismatch` says it; None when they are."""
    if len(found) < len(model):
        return f"{len(found)} layers, the model has {len(model)}"
    for index, (have, want) in enumerate(zip(found, model)):
        if have != want:
            return f"layer {index} holds {describe_form(have)}, the model's {describe_form(want)}"
    return None


def describe_form(form: LayerForm) -> str:
    """``keys float32[1,4,T,64], values ...``: a layer's form, T its token count."""
    def dims(shape: tuple[int, ...]) -> str:
        return "[" + ",".join("T" if size == -1 else str(size) for size in shape) + "]"

    return ", ".join(f"{name} {dtype}{dims(shape)}" for name, dtype, shape in form) or "nothing"


@attrs.frozen(kw_only=True)
class LayerHeader:
    """A stored layer without its tensors: enough for a codec's ``header_trimmable``."""

    codec: str
    provider: str
    meta: Mapping[str, Any]


@attrs.frozen(kw_only=True)
class EntryHeader:
    """A stored entry as ``scan`` lists it: read from the header alone, no tensor bytes."""

    key: str
    tokens: tuple[int, ...]
    layers: tuple[LayerHeader, ...]
    namespace: str
    #: Bytes the entry occupies on disk; byte caps are enforced on this (invariant 10).
    nbytes: int
    #: Last write or read (seconds since the epoch); least recently used is evicted first.
    last_used: float


def entry_key(identity: StoreIdentity, namespace: str, tokens: Sequence[int], version: int) -> str:
    """The storage key of an entry: the same prompt state gets the same key, so rewriting
    it replaces the old file atomically instead of adding a duplicate. Identity and format
    version are part of it, so entries of another tokenizer or format never collide."""
    digest = hashlib.blake2b(digest_size=16)
    head = [version, identity.model_fingerprint, identity.kv_scheme, identity.model_id,
            identity.tokenizer_hash, namespace, len(tokens)]
    digest.update(json.dumps(head).encode())
    digest.update(array("q", tokens).tobytes())
    return digest.hexdigest()
