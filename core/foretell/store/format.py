"""The on-disk form of one cache entry: a valid safetensors file that describes itself.

Byte layout (the safetensors format): ``u64 LE header length`` · header JSON (space padded so
tensor data starts 8-byte aligned) · tensor bytes, laid out back to back. The header's
``__metadata__`` holds three strings:

- ``foretell.format_version``: read first, so a file from another foretell version is
  skipped (kept for that version) rather than mistaken for a corrupt one;
- ``foretell.header``: the foretell header JSON (identity, tokens, per-layer codec meta and
  a table of every tensor with its offsets and XXH3-64 checksum);
- ``foretell.header_hash``: BLAKE2b-128 of that JSON. It authenticates the tensor table, so
  the safetensors index a user's tool reads is checked against it too.

Checksums are fixed-width hex, so the header is written once with placeholders, tensors are
streamed (peak extra memory: one tensor), and the header is rewritten in place with the same
length. See docs/cache-storage.md for the fields and the measured checksum cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import TYPE_CHECKING, Any, BinaryIO

import attrs
import xxhash

# The store's errors live with the layout contract (foretell.store.layout).
from foretell.store.entry import Entry, LayerHeader, LayerState, StoreIdentity
from foretell.store.layout import CorruptEntry, ForeignEntry, UnknownVersion

if TYPE_CHECKING:
    import mlx.core as mx

#: 2: XXH3-64 tensor checksums (1 had CRC-32); a file of another version is never served.
FORMAT_VERSION = 2
SUFFIX = ".safetensors"
#: safetensors refuses headers above 100 MB; a larger length field is corruption.
MAX_HEADER_BYTES = 100_000_000

_VERSION_KEY = "foretell.format_version"
_HEADER_KEY = "foretell.header"
_HASH_KEY = "foretell.header_hash"
_CHECKSUM_PLACEHOLDER = "0" * 16
_HASH_PLACEHOLDER = "0" * 32

# mlx dtype name -> safetensors dtype code
_ST_DTYPES = {
    "bool": "BOOL", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
}


@attrs.frozen
class TensorSlot:
    name: str  # the safetensors tensor name
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]
    begin: int  # offsets relative to the start of tensor data
    end: int
    checksum: str


@attrs.frozen
class StoredHeader:
    """A verified foretell header, plus where its tensor data starts in the file."""

    fields: dict[str, Any]
    layers: tuple[LayerHeader, ...]
    slots: tuple[dict[str, TensorSlot], ...]  # per layer: codec tensor name -> slot
    data_start: int

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.fields["tokens"])

    @property
    def namespace(self) -> str:
        return self.fields["namespace"]


#: What ``checksum`` computes, as the headers name it.
CHECKSUM = "xxh3-64"


def checksum(*parts: Any) -> str:
    """XXH3-64 of the parts' bytes, in order, as 16 hex digits (any buffer: bytes,
    memoryview, a contiguous array). 10-45 GB/s on one core of the dev VM, 3-15x zlib's
    CRC-32 (docs/cache-storage.md); it guards against damage, not adversaries."""
    if len(parts) == 1:  # one buffer: the one-shot call releases the GIL while it hashes
        return f"{xxhash.xxh3_64_intdigest(parts[0]):016x}"
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(part)
    return state.hexdigest()


def header_hash(header_json: str) -> str:
    return hashlib.blake2b(header_json.encode(), digest_size=16).hexdigest()


def dtype_code(array: mx.array) -> str:
    name = str(array.dtype).rsplit(".", 1)[-1]
    try:
        return _ST_DTYPES[name]
    except KeyError:
        raise TypeError(f"cannot store a tensor of dtype {name} (safetensors has no such type)") from None


def host_array(array: mx.array) -> Any:
    """A numpy view of the array's memory (strided like it, no copy); bfloat16 as uint16."""
    import mlx.core as mx
    import numpy as np

    if array.dtype == mx.bfloat16:  # numpy has no bfloat16; the bytes are what matter
        raw = memoryview(array)
        if raw.c_contiguous:  # read in place: no MLX op, so a writer thread may call this
            return np.frombuffer(raw.cast("B"), dtype=np.uint16).reshape(array.shape)
        array = array.view(mx.uint16)
    return np.asarray(array)


def host_bytes(array: mx.array) -> memoryview:
    """The array's row-major bytes; copies only when the array is a strided view."""
    import numpy as np

    host = np.ascontiguousarray(host_array(array))
    return memoryview(host).cast("B") if host.size else memoryview(b"")


def entry_fields(version: int | str, entry: Entry, identity: StoreIdentity,
                 created_at: float) -> dict[str, Any]:
    """The header fields every layout's entry starts with: its format version, when it was
    written, whose it is (checked by :func:`check_identity` on every read) and its tokens."""
    return {
        "format_version": version,
        "created_at": created_at,
        "model_id": identity.model_id,
        "model_fingerprint": identity.model_fingerprint,
        "kv_scheme": identity.kv_scheme,
        "tokenizer_hash": identity.tokenizer_hash,
        "namespace": entry.namespace,
        "num_tokens": len(entry.tokens),
        "tokens": list(entry.tokens),
    }


class EntryWriter:
    """Lays one entry out as a safetensors file: plan once, then stream it to a descriptor."""

    def __init__(self, entry: Entry, identity: StoreIdentity, created_at: float):
        self.entry = entry
        offset = 0
        layers = []
        self._order: list[tuple[str, Any]] = []
        for index, layer in enumerate(entry.layers):
            table = {}
            for tname, array in layer.tensors.items():
                name = f"layers.{index}.{tname}"
                nbytes = array.nbytes
                table[tname] = {"name": name, "dtype": dtype_code(array),
                                "shape": list(array.shape), "offsets": [offset, offset + nbytes],
                                "xxh3": _CHECKSUM_PLACEHOLDER}
                self._order.append((name, array))
                offset += nbytes
            layers.append({"codec": layer.codec, "provider": layer.provider,
                           "meta": dict(layer.meta), "tensors": table})
        self.data_bytes = offset
        self._fields = {
            **entry_fields(FORMAT_VERSION, entry, identity, created_at),
            "data_bytes": offset,
            "checksum": CHECKSUM,
            "layers": layers,
        }
        self._checksums: dict[str, str] = {}
        self.header = self._render()
        self.file_bytes = len(self.header) + self.data_bytes

    def _render(self) -> bytes:
        for layer in self._fields["layers"]:
            for slot in layer["tensors"].values():
                slot["xxh3"] = self._checksums.get(slot["name"], _CHECKSUM_PLACEHOLDER)
        header_json = json.dumps(self._fields, separators=(",", ":"))
        done = len(self._checksums) == len(self._order)
        index: dict[str, Any] = {"__metadata__": {
            _VERSION_KEY: str(FORMAT_VERSION),
            _HEADER_KEY: header_json,
            _HASH_KEY: header_hash(header_json) if done else _HASH_PLACEHOLDER,
        }}
        for layer in self._fields["layers"]:
            for slot in layer["tensors"].values():
                index[slot["name"]] = {"dtype": slot["dtype"], "shape": slot["shape"],
                                       "data_offsets": slot["offsets"]}
        body = json.dumps(index, separators=(",", ":")).encode()
        body += b" " * (-(8 + len(body)) % 8)  # tensor data 8-byte aligned, as safetensors advises
        return struct.pack("<Q", len(body)) + body

    def stored_layers(self) -> tuple[LayerHeader, ...]:
        """The layers as a later :func:`read_header` will see them (meta after JSON)."""
        return tuple(
            LayerHeader(codec=layer["codec"], provider=layer["provider"],
                        meta=json.loads(json.dumps(layer["meta"])))
            for layer in self._fields["layers"]
        )

    def write_to(self, fd: int) -> None:
        """Write the whole file at the descriptor's start; every byte goes through os.write."""
        write_all(fd, self.header)
        for name, array in self._order:
            data = host_bytes(array)
            self._checksums[name] = checksum(data)
            write_all(fd, data)
            del data
        final = self._render()
        # Checksums are fixed-width hex, so the final header must fit the placeholder's bytes.
        if len(final) != len(self.header):
            raise AssertionError("entry header changed length between plan and write")
        os.lseek(fd, 0, os.SEEK_SET)
        write_all(fd, final)
        self.header = final


def write_all(fd: int, data: Any) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_header(fh: BinaryIO, file_size: int, identity: StoreIdentity) -> StoredHeader:
    """Parse and verify an entry's header without touching tensor bytes.

    :raises CorruptEntry: damaged, truncated, or not an entry.
    :raises UnknownVersion: another format version wrote it.
    :raises ForeignEntry: another model, tokenizer, KV scheme or codec wrote it.
    """
    prefix = fh.read(8)
    if len(prefix) != 8:
        raise CorruptEntry("shorter than the safetensors length prefix")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or 8 + length > file_size:
        raise CorruptEntry(f"header length {length} does not fit a {file_size}-byte file")
    raw = fh.read(length)
    try:
        index = json.loads(raw)
        meta = index.pop("__metadata__")
        version = meta[_VERSION_KEY]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptEntry(f"not a foretell entry header: {exc}") from None
    if version != str(FORMAT_VERSION):
        raise UnknownVersion(f"format version {version!r}, this foretell reads {FORMAT_VERSION}")
    header_json = meta.get(_HEADER_KEY)
    if not isinstance(header_json, str) or meta.get(_HASH_KEY) != header_hash(header_json):
        raise CorruptEntry("header hash mismatch")
    try:
        return _parse_verified(json.loads(header_json), index, 8 + length, file_size, identity)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptEntry(f"malformed header: {type(exc).__name__}: {exc}") from None


def _parse_verified(fields: dict[str, Any], index: dict[str, Any], data_start: int,
                    file_size: int, identity: StoreIdentity) -> StoredHeader:
    if data_start + fields["data_bytes"] != file_size:
        raise CorruptEntry(
            f"file is {file_size} bytes, its header says {data_start + fields['data_bytes']}"
        )
    check_identity(fields, identity)
    layers, slots = [], []
    for layer in fields["layers"]:
        layers.append(LayerHeader(codec=layer["codec"], provider=layer["provider"],
                                  meta=layer["meta"]))
        table = {}
        for tname, slot in layer["tensors"].items():
            stored = TensorSlot(slot["name"], slot["dtype"], tuple(slot["shape"]),
                                slot["offsets"][0], slot["offsets"][1], slot["xxh3"])
            # The safetensors index is what other tools read: it must agree with the
            # authenticated table, or a user would see different tensors than we verify.
            seen = index.pop(stored.name, None)
            if seen != {"dtype": stored.dtype, "shape": list(stored.shape),
                        "data_offsets": [stored.begin, stored.end]}:
                raise CorruptEntry(f"tensor {stored.name} disagrees with the verified header")
            table[tname] = stored
        slots.append(table)
    if index:
        raise CorruptEntry(f"tensors missing from the verified header: {sorted(index)[:3]}")
    return StoredHeader(fields=fields, layers=tuple(layers), slots=tuple(slots),
                        data_start=data_start)


def check_identity(fields: dict[str, Any], identity: StoreIdentity) -> None:
    for field in ("model_fingerprint", "kv_scheme", "model_id", "tokenizer_hash"):
        if fields[field] != getattr(identity, field):
            raise ForeignEntry(f"{field} is {fields[field]!r}, this store serves "
                               f"{getattr(identity, field)!r}")
    for layer in fields["layers"]:
        if layer["provider"] not in identity.codec_providers:
            raise ForeignEntry(f"codec provider {layer['provider']!r} is not loaded here")


def read_layers(fh: BinaryIO, header: StoredHeader, *, verify: bool = True) -> list[LayerState]:
    """Every tensor of the entry, each checked against its checksum before it is returned.

    MLX's own loader reads the tensors straight into the arrays it returns (no host buffer
    to copy from); checksums run on a thread pool over zero-copy views while later tensors
    load, so verification overlaps the reading. On a host with at least
    :data:`PARALLEL_READ_CORES` cores MLX reads every tensor at once on its I/O threads;
    with fewer, one at a time, which measured faster there (docs/block-store.md).
    ``verify=False`` exists for the benchmark that measures what verification costs;
    serving always verifies.

    :raises CorruptEntry: a tensor's bytes are short, unreadable or do not match their
        checksum. :raises FileReplaced: the path names another file (or none) by now.
    """
    import mlx.core as mx

    try:
        try:
            loaded = mx.load(fh.name, format="safetensors", stream=mx.cpu)
        except (RuntimeError, ValueError, OSError) as exc:
            raise CorruptEntry(f"its tensors cannot be loaded: {exc}") from None
        layers, order = [], []
        for layer, table in zip(header.layers, header.slots):
            tensors = {}
            for tname, slot in table.items():
                array = loaded.get(slot.name)
                if array is None or tuple(array.shape) != slot.shape or dtype_code(array) != slot.dtype:
                    raise CorruptEntry(f"tensor {slot.name} disagrees with the verified header")
                tensors[tname] = array
                order.append((slot, array))
            layers.append(LayerState(codec=layer.codec, provider=layer.provider,
                                     meta=layer.meta, tensors=tensors))
        if parallel_reads():
            mx.async_eval([array for _slot, array in order])
        checks = []
        for slot, array in order:
            try:
                mx.eval(array)  # reads this tensor (or waits for it); earlier ones are being checksummed
            except RuntimeError as exc:  # the bytes could not be read (short, or an I/O error)
                raise CorruptEntry(f"tensor {slot.name} cannot be read: {exc}") from None
            if verify:
                checks.append((slot, io_pool().submit(_checksum_view, array)))
        for slot, future in checks:
            if future.result() != slot.checksum:
                raise CorruptEntry(f"tensor {slot.name} fails its checksum")
    except CorruptEntry:
        # MLX reads by path, and the path may have been replaced (an atomic rewrite) or
        # removed (an eviction) since ``fh`` was opened: then the bytes are another
        # version's or gone, not damage. Say so instead of deleting a good file.
        if not _same_file(fh):
            raise FileReplaced(fh.name) from None
        raise
    if not _same_file(fh):
        raise FileReplaced(fh.name)
    return layers


def _same_file(fh: BinaryIO) -> bool:
    """Whether ``fh``'s path still names the file ``fh`` has open."""
    try:
        return os.stat(fh.name).st_ino == os.fstat(fh.fileno()).st_ino
    except OSError:
        return False


#: Cores from which a read lets MLX load every tensor of an entry at once (see read_layers).
PARALLEL_READ_CORES = 8


def parallel_reads() -> bool:
    """Whether this host reads an entry's tensors all at once (many cores) or one at a
    time (few)."""
    return (os.cpu_count() or 1) >= PARALLEL_READ_CORES


class FileReplaced(OSError):
    """The entry's file was atomically replaced, or removed, while it was being read."""


def _checksum_view(array: mx.array) -> str:
    # An evaluated, contiguous array: its buffer is read in place, no MLX work and no numpy
    # (importing numpy cost a fresh process 0.14 s before its first restore).
    return checksum(memoryview(array).cast("B") if array.size else b"")


_POOLS: dict[str, Any] = {}


def io_pool() -> Any:
    """The store's reader threads. XXH3 over one buffer, hashlib and file I/O release the
    GIL, so checksums of several tensors (and a block store's blocks) run in parallel."""
    return _pool("foretell-store")


def write_pool() -> Any:
    """The store's writer threads (a block store's blocks in parallel), each at
    :func:`background_priority`; reads keep their own pool at normal priority."""
    return _pool("foretell-store-write", background_priority)


def _pool(name: str, initializer: Any = None) -> Any:
    if name not in _POOLS:
        from concurrent.futures import ThreadPoolExecutor

        _POOLS[name] = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                          thread_name_prefix=name, initializer=initializer)
    return _POOLS[name]


#: The nice value cache writes run at. Beside a spill worker that never runs dry, on the
#: 2-core dev VM, decode ran at 0.75-0.89x idle with the writer at nice 0 and 0.84-0.99x at
#: 10; at 19 writes starved under load (docs/cache-storage.md#writes-run-at-low-cpu-priority).
WRITE_NICENESS = 10


def background_priority() -> None:
    """Run the calling thread at :data:`WRITE_NICENESS` from now on, so writes take the CPU
    decoding leaves idle. Linux only, where nice is per thread (elsewhere setpriority would
    slow the whole process); for good, since an unprivileged thread cannot raise it back."""
    import sys
    import threading

    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < WRITE_NICENESS:
            os.setpriority(os.PRIO_PROCESS, tid, WRITE_NICENESS)
    except OSError:
        pass  # a sandbox refusing setpriority: writes run at the priority they had
