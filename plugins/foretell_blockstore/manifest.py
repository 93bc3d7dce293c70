"""How an entry is cut into blocks, and the manifest that lists them.

**Cutting.** Every tensor is cut along its second-to-last axis (the token axis of every KV
form: ``[B, heads, tokens, dim]`` plain, and the packed/scales/biases of quantized KV) into
runs of ``block_rows`` rows starting at row 0. Tensors of one codec provider with the same
number of rows form a *group*, and block ``j`` of a group holds rows
``[j*block_rows, (j+1)*block_rows)`` of every tensor in the group, back to back in layer
order. So every layer of one token range is one block file: an entry of 2,048 tokens is 8
blocks at 256, whatever the model's depth (plus a drafter's state, in blocks of its own).

Rows of a growing cache are token positions, so two entries sharing a token prefix have
byte-identical leading blocks. A wrapped ring (rows = ring slots, not positions) forms its
own group cut by slot range; a later checkpoint of the same ring rewrites only the slot
ranges new tokens overwrote. Tensors of fewer than 2 dims are one row. The layout needs
no knowledge of the codec: cutting decides only what dedupes, never what is served.

**Identity.** A block is named by the XXH3-128 of its file (docs/block-store.md has the
measurement that chose content naming over a token hash chain, and XXH3-128 over SHA-256):
equal bytes are stored once, and a reader always gets back exactly the bytes that were
written. The name is computed at write time only; 128 bits make two different blocks'
names equal by accident as unlikely as damage passing a read's checks. Manifests written
before 2026-12-03 name their blocks by SHA-256 (``block_id`` says which) and read as they
are. The manifest records each block's size and its checksum, the XXH3-64 of its pieces'
XXH3-64s (a piece: one tensor's rows in the block, contiguous in the file), which a read
verifies piece by piece as each lands. A manifest written on a CUDA GPU also records each
tensor's device digest (``foretell.store.digest``), which a reader there checks instead, on
the GPU once every block has landed; other readers ignore it.

**Files.** A block is a safetensors file whose tensors ``"0"``, ``"1"``... are its pieces;
its header depends only on the group's dtypes and shapes, so a reader knows it exactly. A
manifest is a safetensors file with no tensors whose ``__metadata__`` holds the header JSON
(identity, tokens, per-layer codec meta, every tensor's dtype and shape, and each group's
block list) and its BLAKE2b-128 hash, as the single-file format does.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import xxhash

from foretell.store import digest
from foretell.store import format as fmt
from foretell.store.entry import Entry, LayerHeader, StoreIdentity
from foretell.store.layout import CorruptEntry, UnknownVersion

if TYPE_CHECKING:
    import mlx.core as mx
    import numpy as np

    from foretell.store import BufferReserve

#: Version of the manifest and block format (4: XXH3-64 per piece, the checksums format 2
#: had; 3 had one per run, whose 128 KiB calls did not scale over readers on many cores;
#: 1 CRC-32). A reader of another version skips the entry. The number only goes up (every
#: block header carries it), so format 2's stores are skipped, not read by code they were
#: not written for.
FORMAT_VERSION = "blocks/4"
#: The largest manifest a reader reads: its length prefix and the longest header any
#: safetensors reader accepts. A larger file is refused by its size, before it is read.
MAX_MANIFEST_BYTES = 8 + fmt.MAX_HEADER_BYTES
_VERSION_KEY = "foretell.format_version"
_HEADER_KEY = "foretell.header"
_HASH_KEY = "foretell.header_hash"
_BLOCK_KEY = "foretell.block"
#: The hashes a manifest's ``block_id`` may name its blocks by (each over the block's file).
NAMINGS = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
#: How new blocks are named.
BLOCK_NAMING = "xxh3-128"
_DIGEST = re.compile("^[0-9a-f]{16}$")
_BLOCK_IDS = {name: re.compile(f"^[0-9a-f]{{{2 * hasher().digest_size}}}$")
              for name, hasher in NAMINGS.items()}
_MX_DTYPES = {"BOOL": "bool_", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
              "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "F16": "float16",
              "BF16": "bfloat16", "F32": "float32", "F64": "float64"}
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


@attrs.frozen
class BlockRef:
    id: str  # SHA-256 of the block's bytes, hex
    nbytes: int
    checksum: str  # XXH3-64 over its pieces' XXH3-64s (block_checksum)


@attrs.frozen
class TensorSpec:
    layer: int
    name: str
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    def row_bytes(self) -> int:
        """Bytes of one row (all leading dims, one step of the row axis)."""
        total = _ITEM_BYTES[self.dtype]
        for size in self.shape:
            total *= size
        return total // self.rows if self.rows else 0

    def piece_bytes(self, begin: int, end: int) -> int:
        return self.row_bytes() * (end - begin)


@attrs.frozen
class Group:
    """Tensors with one row count, cut together into blocks of ``block_rows`` rows."""

    rows: int
    tensors: tuple[TensorSpec, ...]

    def spans(self, block_rows: int) -> Iterator[tuple[int, int]]:
        for begin in range(0, self.rows, block_rows):
            yield begin, min(begin + block_rows, self.rows)

    def block_bytes(self, begin: int, end: int) -> int:
        return sum(t.piece_bytes(begin, end) for t in self.tensors)


def plan_groups(entry: Entry) -> tuple[Group, ...]:
    """The entry's tensors grouped by row count and codec provider, in layer order within
    each group; groups by row count, then by their first layer.

    The provider keeps a drafter's state (its attachment layer) out of the target's
    blocks: it differs between entries that share the target's prefix, and when its rows
    matched the target's it spoiled every block it joined (two entries sharing 990 tokens
    shared none)."""
    groups: dict[tuple[int, str], list[TensorSpec]] = {}
    for index, layer in enumerate(entry.layers):
        for name, array in layer.tensors.items():
            spec = TensorSpec(index, name, fmt.dtype_code(array), tuple(array.shape))
            if spec.rows and array.size:
                groups.setdefault((spec.rows, layer.provider), []).append(spec)
    return tuple(Group(rows, tuple(specs)) for (rows, _provider), specs in
                 sorted(groups.items(), key=lambda item: (item[0][0], item[1][0].layer)))


def host_views(entry: Entry) -> dict[tuple[int, str], np.ndarray]:
    """Numpy views of every tensor's memory (evaluating them: call on the MLX thread)."""
    return {(index, name): fmt.host_array(array)
            for index, layer in enumerate(entry.layers) for name, array in layer.tensors.items()}


def block_pieces(hosts: dict[tuple[int, str], np.ndarray], group: Group, begin: int,
                 end: int) -> list[list[memoryview]]:
    """Rows ``[begin, end)`` of every tensor of ``group``, piece by piece in file order, each
    piece as its runs (one per leading index) viewed in the arrays' own memory: a block is
    hashed and written without being packed into a buffer first (packing cost one copy of
    the entry into fresh memory per write, and its page faults slowed a decode running
    beside it). A run that is not contiguous in memory is copied. ``hosts`` from
    :func:`host_views`."""
    import numpy as np

    pieces = []
    for spec in group.tensors:
        host = hosts[(spec.layer, spec.name)]
        if host.ndim < 2:
            pieces.append([_bytes_of(np.ascontiguousarray(host))])
            continue
        rows = host.reshape(-1, *host.shape[-2:])[:, begin:end, :]
        if rows[0].nbytes < PACK_RUNS_BELOW:
            # Many small runs (quantized KV's scales and biases: 4 bytes a row) cost a hash
            # update and a write each, every one a hand-over of the GIL that a decode beside
            # the writer waits on; packed, the piece is one of each for a small copy.
            pieces.append([_bytes_of(np.ascontiguousarray(rows))])
            continue
        pieces.append([_bytes_of(run if run.flags.c_contiguous else np.ascontiguousarray(run))
                       for run in rows])
    return pieces


#: A piece whose runs (one per leading index) are smaller than this is copied into one
#: buffer before it is hashed and written: each small run hashed and written alone hands
#: the GIL over once, and a decode beside the writer waits on every hand-over; this
#: threshold kept such a decode at full speed where 64 KiB did not (docs/block-store.md).
#: Larger runs (bf16 KV) stay views: copying them costs page faults and buys nothing.
PACK_RUNS_BELOW = 128 << 10


def _bytes_of(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B") if array.size else memoryview(b"")


def piece_shape(spec: TensorSpec, begin: int, end: int) -> tuple[int, ...]:
    return (*spec.shape[:-2], end - begin, spec.shape[-1]) if len(spec.shape) >= 2 else spec.shape


def block_header(group: Group, begin: int, end: int) -> bytes:
    """The safetensors header of one block file: its pieces ``"0"``, ``"1"``... in group
    order. A function of the group's dtypes and shapes alone, so equal bytes still give
    equal block files, and a reader knows a block's header and size before opening it."""
    return _block_header(group, end - begin)


@functools.lru_cache(maxsize=256)
def _block_header(group: Group, rows: int) -> bytes:
    index: dict[str, Any] = {"__metadata__": {_BLOCK_KEY: FORMAT_VERSION}}
    offset = 0
    for i, spec in enumerate(group.tensors):
        nbytes = spec.piece_bytes(0, rows)
        index[str(i)] = {"dtype": spec.dtype, "shape": list(piece_shape(spec, 0, rows)),
                         "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(index, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def block_ref(header: bytes, pieces: list[list[memoryview]]) -> BlockRef:
    """A block's name (XXH3-128 of the whole file), size, and checksum (what reads verify),
    from its header and its pieces (:func:`block_pieces`)."""
    digest, checksums = NAMINGS[BLOCK_NAMING](header), []
    for runs in pieces:
        for run in runs:
            digest.update(run)
        # Right after the name's hash has read it, so the piece is still in the CPU cache:
        # one pass over the entry's memory instead of two.
        checksums.append(fmt.checksum(*runs))
    nbytes = len(header) + sum(run.nbytes for runs in pieces for run in runs)
    return BlockRef(digest.hexdigest(), nbytes, block_checksum(checksums))


def block_checksum(pieces: list[str]) -> str:
    """A block's checksum from its pieces' checksums (``fmt.checksum`` of each piece's runs,
    in file order). Reads check each piece right after it lands, while its bytes are in the
    cache: a reader that lands it in one buffer (``foretell.platform.cuda``'s staging)
    hashes it in one call, which releases the GIL and scales over readers; one that reads it
    straight into its tensor hashes its runs as one stream. Same digest."""
    return fmt.checksum(bytes.fromhex("".join(pieces)))


def destinations(group: Group, begin: int, end: int,
                 flats: dict[tuple[int, str], memoryview]) -> list[list[memoryview]]:
    """Where a block's tensor bytes go, piece by piece in file order: for each tensor of the
    group, the rows ``[begin, end)`` of each leading index, as slices of the tensor's flat
    byte buffer (``flats``), so one ``preadv`` puts a piece straight into place."""
    pieces = []
    for spec in group.tensors:
        flat = flats[(spec.layer, spec.name)]
        if len(spec.shape) < 2:
            pieces.append([flat])
            continue
        row = spec.shape[-1] * _ITEM_BYTES[spec.dtype]  # one row of one leading index
        span = spec.rows * row
        pieces.append([flat[lead + begin * row:lead + end * row]
                       for lead in range(0, len(flat), span)])
    return pieces


#: Where each block's tensor bytes start in a landing area (foretell.platform.cuda).
LANDING_ALIGN = 256


def landing_bytes(blocks: tuple[BlockRef, ...] | list[BlockRef]) -> int:
    """At least what :func:`landing_plan` asks of a landing area for an entry of ``blocks``."""
    return sum(-(-ref.nbytes // LANDING_ALIGN) * LANDING_ALIGN for ref in blocks)


def run_layout(host: np.ndarray) -> tuple[int, int] | None:
    """Where a tensor's rows lie, for copies that address them (a write gathered by DMA):
    its first byte's address and the bytes from one leading index's rows to the next's;
    None unless each leading index's rows are one contiguous run and the runs lie at one
    pitch (a cache's snapshot, a token slice of a larger buffer, does; a transposed view
    does not). ``host`` from :func:`host_views`."""
    address = host.__array_interface__["data"][0]
    if host.ndim < 2:
        return (address, host.nbytes) if host.flags.c_contiguous else None
    item, row = host.itemsize, host.shape[-1] * host.itemsize
    if host.strides[-1] != item or (host.shape[-2] > 1 and host.strides[-2] != row):
        return None
    leads = [(size, stride) for size, stride in zip(host.shape[:-2], host.strides[:-2])
             if size > 1]
    if not leads:
        return address, host.shape[-2] * row
    pitch = leads[-1][1]
    if pitch < host.shape[-2] * row:
        return None
    for (_outer, outer_stride), (inner, inner_stride) in zip(leads, leads[1:]):
        if outer_stride != inner_stride * inner:
            return None
    return address, pitch


def piece_plan(groups: Sequence[Group], block_rows: int,
               addresses: dict[tuple[int, str], int],
               pitches: dict[tuple[int, str], int] | None = None
               ) -> tuple[list[int], int, np.ndarray]:
    """How an entry's blocks lie in one contiguous area (``foretell.platform.cuda``): each
    block's tensor bytes (its file past the header) at an offset of their own, 256-byte
    aligned, blocks in group order; within a block, its pieces back to back, as in the
    file. Returns the blocks' offsets, the bytes the area needs, and one row per piece:
    (offset in the area, address of its first run in the tensor, run bytes, runs, bytes
    from one run to the next in the tensor), the tensors' flat buffers at ``addresses``
    (their leading indices ``pitches`` bytes apart where given: :func:`run_layout`; a
    contiguous tensor's otherwise). A piece's runs are the slices :func:`destinations`
    gives (one per leading index)."""
    import numpy as np

    offsets, rows, at = [], [], 0
    for group in groups:
        leads = np.array([_size(s.shape[:-2]) if len(s.shape) >= 2 else 1
                          for s in group.tensors], dtype=np.uint64)
        widths = np.array([s.shape[-1] * _ITEM_BYTES[s.dtype] if len(s.shape) >= 2
                           else s.piece_bytes(0, 1) for s in group.tensors], dtype=np.uint64)
        bases = np.array([addresses[(s.layer, s.name)] for s in group.tensors],
                         dtype=np.uint64)
        strides = (widths * np.uint64(group.rows) if pitches is None else
                   np.array([pitches[(s.layer, s.name)] for s in group.tensors],
                            dtype=np.uint64))
        for begin, end in group.spans(block_rows):
            offsets.append(at)
            run = widths * np.uint64(end - begin)
            size = run * leads
            rows.append(np.stack([np.uint64(at) + np.cumsum(size) - size,
                                  bases + np.uint64(begin) * widths, run, leads,
                                  strides], axis=1))
            at += -(-int(size.sum()) // LANDING_ALIGN) * LANDING_ALIGN
    pieces = np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.uint64)
    return offsets, at, pieces


def landing_plan(manifest: Manifest, addresses: dict[tuple[int, str], int]
                 ) -> tuple[list[int], int, np.ndarray]:
    """How an entry lands whole (``foretell.platform.cuda.LandingArea``): the blocks'
    offsets and the bytes as :func:`piece_plan`, and every run to copy from the area to
    its tensor: (offset in the area, destination address, bytes), one row per leading
    index of each piece."""
    import numpy as np

    offsets, need, pieces = piece_plan([g for g, _refs in manifest.groups],
                                       manifest.block_rows, addresses)
    counts = pieces[:, 3].astype(np.int64)
    at = np.arange(int(counts.sum()), dtype=np.uint64) - np.repeat(
        (np.cumsum(pieces[:, 3]) - pieces[:, 3]), counts)
    offset, first, run, _count, pitch = (np.repeat(pieces[:, k], counts) for k in range(5))
    return offsets, need, np.stack([offset + at * run, first + at * pitch, run], axis=1)


def host_buffers(specs: list[TensorSpec], *, on_gpu: bool = False,
                 reserve: BufferReserve | None = None) -> list[tuple[mx.array, memoryview]]:
    """MLX-owned buffers, one per tensor (uint8: its shape, the last axis counted in
    bytes), each with a writable flat view of the same memory: blocks are read straight
    into the arrays that are returned, with no copy after the read.

    From ``reserve`` when it holds enough for all of them (views carved from a slab filled
    before the restore: ``foretell.store.reserve``), so the read pays no fill; otherwise
    fresh.

    MLX has no uninitialized allocation (``mx.empty`` is ``mx.zeros``), so each buffer is
    zero-filled first: one pass over the entry's memory that a single-file read does not
    pay (docs/block-store.md). ``on_gpu`` fills them on the GPU, so a CUDA GPU's managed
    memory is born there and the read copies into it by DMA (``foretell.platform.cuda``).
    Otherwise, on a host with many cores (``store.format.parallel_reads``) the fills run on
    several CPU streams at once, whose threads MLX runs in parallel; with few cores several
    streams measured slower, so it fills on one there (docs/block-store.md)."""
    import mlx.core as mx

    shapes = [(*shape[:-1], shape[-1] * _ITEM_BYTES[spec.dtype])
              for spec in specs for shape in [spec.shape if spec.shape else (1,)]]
    carved = reserve.take([_size(shape) for shape in shapes]) if reserve is not None else None
    if carved is not None:
        # A reshape of a contiguous view is a view: the flat views below write into the
        # reserve's slab, which is what the returned arrays hold.
        buffers = [view.reshape(shape) for view, shape in zip(carved, shapes)]
        mx.eval(buffers)
        return [(buffer, memoryview(buffer).cast("B")) for buffer in buffers]
    streams = [mx.gpu] if on_gpu else _fill_streams()
    buffers = [mx.zeros(shape, dtype=mx.uint8, stream=streams[i % len(streams)])
               for i, shape in enumerate(shapes)]
    mx.eval(buffers)
    return [(buffer, memoryview(buffer).cast("B")) for buffer in buffers]


#: CPU streams the buffers of a read are zero-filled on, by host size (see host_buffers).
FILL_STREAMS = 8
_STREAMS: list[Any] = []


def _fill_streams() -> list[Any]:
    import mlx.core as mx

    if not fmt.parallel_reads():
        return [mx.cpu]
    if not _STREAMS:
        # Thread-local (MLX >= 0.30): a plain stream exists only in the thread that made it,
        # and a restore on another thread then failed ("There is no Stream(cpu, 5) in
        # current thread") and fell back to the prefill.
        make = getattr(mx, "new_thread_local_stream", mx.new_stream)
        _STREAMS.extend(make(mx.cpu) for _ in range(FILL_STREAMS))
    return _STREAMS


def buffer_bytes(groups: Iterator[Group] | tuple[Group, ...]) -> int:
    """What :func:`host_buffers` takes from a reserve for an entry of these groups (each
    buffer on the reserve's alignment)."""
    from foretell.store.reserve import aligned

    return sum(aligned(spec.piece_bytes(0, spec.rows)) for group in groups
               for spec in group.tensors)


def largest_tensor(groups: Iterator[Group] | tuple[Group, ...]) -> int:
    """The bytes of the largest tensor of an entry of these groups."""
    return max((spec.piece_bytes(0, spec.rows) for group in groups for spec in group.tensors),
               default=0)


def to_array(buffer: mx.array, spec: TensorSpec) -> mx.array:
    """The tensor a filled :func:`host_buffers` buffer holds (a view of it, no copy)."""
    import mlx.core as mx

    return buffer.view(getattr(mx, _MX_DTYPES[spec.dtype])).reshape(spec.shape)


def empty_array(spec: TensorSpec) -> mx.array:
    import mlx.core as mx

    return mx.zeros(spec.shape, dtype=getattr(mx, _MX_DTYPES[spec.dtype]))


def layer_states(manifest: Manifest, buffers: dict[tuple[int, str], Any]) -> list[Any]:
    """The entry's layers over its filled buffers (``{(layer, name): (buffer, ...)}``, as
    :func:`host_buffers` made them; a tensor with none is empty), evaluated: what a reader
    returns once every block it placed passed its checks."""
    import mlx.core as mx

    from foretell.store.entry import LayerState

    layers, arrays = [], []
    for index, (layer, table) in enumerate(zip(manifest.layers, manifest.fields["layers"])):
        tensors = {}
        for name, tensor in table["tensors"].items():
            spec = TensorSpec(index, name, tensor["dtype"], tuple(tensor["shape"]))
            found = buffers.get((index, name))
            tensors[name] = to_array(found[0], spec) if found else empty_array(spec)
            arrays.append(tensors[name])
        layers.append(LayerState(codec=layer.codec, provider=layer.provider, meta=layer.meta,
                                 tensors=tensors))
    mx.eval(arrays)
    return layers

# -- the manifest ---------------------------------------------------------------------------


@attrs.frozen
class Manifest:
    """A verified manifest: the header fields, the layers, and each group's blocks."""

    fields: dict[str, Any]
    layers: tuple[LayerHeader, ...]
    groups: tuple[tuple[Group, tuple[BlockRef, ...]], ...]
    block_rows: int
    #: Device digests (foretell.store.digest) of every grouped tensor in group order, or
    #: None when the writer recorded none (or of a scheme this reader does not know).
    digests: tuple[int, ...] | None = None

    @property
    def specs(self) -> list[TensorSpec]:
        """Every stored tensor, group by group (the order of ``digests``)."""
        return [spec for group, _refs in self.groups for spec in group.tensors]

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self.fields["tokens"])

    @property
    def namespace(self) -> str:
        return self.fields["namespace"]

    @property
    def blocks(self) -> list[BlockRef]:
        return [ref for _group, refs in self.groups for ref in refs]

    @property
    def tensor_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.blocks)


def render(entry: Entry, identity: StoreIdentity, block_rows: int, created_at: float,
           groups: list[tuple[Group, list[BlockRef]]]) -> bytes:
    """The manifest file's bytes: a safetensors header with no tensors."""
    fields = {
        **fmt.entry_fields(FORMAT_VERSION, entry, identity, created_at),
        "checksum": f"{fmt.CHECKSUM} of piece {fmt.CHECKSUM}s",
        "block_id": BLOCK_NAMING,
        "block_rows": block_rows,
        "layers": [
            {"codec": layer.codec, "provider": layer.provider, "meta": dict(layer.meta),
             "tensors": {name: {"dtype": fmt.dtype_code(a), "shape": list(a.shape)}
                         for name, a in layer.tensors.items()}}
            for layer in entry.layers
        ],
        "groups": [
            {"rows": group.rows,
             "tensors": [[spec.layer, spec.name] for spec in group.tensors],
             "blocks": [[ref.id, ref.nbytes, ref.checksum] for ref in refs]}
            for group, refs in groups
        ],
    }
    found = [entry.digests.get((spec.layer, spec.name)) for group, _refs in groups
             for spec in group.tensors]
    if found and None not in found:
        # Optional and additive: a reader that does not know the field checks the blocks'
        # checksums as before, so the format version stays.
        fields["device_digest"] = digest.SCHEME
        at = 0
        for group, (built, _refs) in zip(fields["groups"], groups):
            count = len(built.tensors)
            group["digests"] = [f"{d:016x}" for d in found[at:at + count]]
            at += count
    header_json = json.dumps(fields, separators=(",", ":"))
    index = {"__metadata__": {_VERSION_KEY: FORMAT_VERSION, _HEADER_KEY: header_json,
                              _HASH_KEY: fmt.header_hash(header_json)}}
    body = json.dumps(index, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def parse(raw: bytes) -> Manifest:
    """Verify and parse a manifest file's bytes (identity is the caller's to check).

    :raises CorruptEntry: damaged, truncated, not a manifest, or inconsistent.
    :raises UnknownVersion: written by another block format version.
    """
    if len(raw) < 8:
        raise CorruptEntry("shorter than the safetensors length prefix")
    (length,) = struct.unpack("<Q", raw[:8])
    if length > fmt.MAX_HEADER_BYTES or 8 + length != len(raw):
        raise CorruptEntry(f"header length {length} does not fit a {len(raw)}-byte manifest")
    try:
        index = json.loads(raw[8:])
        meta = index.pop("__metadata__")
        version = meta[_VERSION_KEY]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptEntry(f"not a block-store manifest: {exc}") from None
    if version != FORMAT_VERSION:
        raise UnknownVersion(f"format version {version!r}, this store reads {FORMAT_VERSION}")
    header_json = meta.get(_HEADER_KEY)
    if not isinstance(header_json, str) or meta.get(_HASH_KEY) != fmt.header_hash(header_json):
        raise CorruptEntry("header hash mismatch")
    if index:
        raise CorruptEntry("a manifest holds no tensors")
    try:
        return _parse_fields(json.loads(header_json))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptEntry(f"malformed manifest: {type(exc).__name__}: {exc}") from None


def listed_block_ids(raw: bytes) -> frozenset[str]:
    """The ids of the blocks a manifest file's bytes list: what ``collect()`` keeps for it.
    A manifest of a block naming or format version this reader does not know is skipped
    and kept (another foretell may serve it), and so are the blocks its block list names
    where that list has this format's shape; where it has not, it keeps none.

    :raises CorruptEntry: damaged, as :func:`parse`."""
    try:
        return frozenset(ref.id for ref in parse(raw).blocks)
    except UnknownVersion:
        pass
    try:
        fields = json.loads(json.loads(raw[8:])["__metadata__"][_HEADER_KEY])
        return frozenset(block[0] for group in fields["groups"] for block in group["blocks"]
                         if isinstance(block[0], str) and _ANY_BLOCK_ID.match(block[0]))
    except (ValueError, KeyError, TypeError, IndexError):
        return frozenset()


#: A block id of any naming, as far as it can name a file in the data folder.
_ANY_BLOCK_ID = re.compile("^[0-9a-f]{16,128}$")


def _parse_fields(fields: dict[str, Any]) -> Manifest:
    block_id = _BLOCK_IDS.get(fields["block_id"])
    if block_id is None:
        raise UnknownVersion(f"blocks named by {fields['block_id']!r}; this store knows "
                             f"{', '.join(sorted(_BLOCK_IDS))}")
    block_rows = int(fields["block_rows"])
    if block_rows < 1:
        raise CorruptEntry(f"block_rows {block_rows}")
    layers, specs = [], {}
    for index, layer in enumerate(fields["layers"]):
        layers.append(LayerHeader(codec=layer["codec"], provider=layer["provider"],
                                  meta=layer["meta"]))
        for name, tensor in layer["tensors"].items():
            if tensor["dtype"] not in _ITEM_BYTES or any(int(s) < 0 for s in tensor["shape"]):
                raise CorruptEntry(f"tensor layers.{index}.{name}: bad dtype or shape")
            specs[(index, name)] = TensorSpec(index, name, tensor["dtype"],
                                              tuple(int(s) for s in tensor["shape"]))
    groups, placed = [], set()
    for group in fields["groups"]:
        members = tuple(specs[(int(layer), name)] for layer, name in group["tensors"])
        built = Group(int(group["rows"]), members)
        if any(spec.rows != built.rows for spec in members) or placed & {
                (s.layer, s.name) for s in members}:
            raise CorruptEntry("a block group's tensors disagree with the tensor table")
        placed |= {(s.layer, s.name) for s in members}
        refs = tuple(BlockRef(str(i), int(n), str(c)) for i, n, c in group["blocks"])
        spans = list(built.spans(block_rows))
        # A block's size is its header's plus its rows', worked out once per row count
        # (per block, a 4,096-token manifest loaded in 1.27 ms on the 2-core Xeon; 0.99).
        sizes = {}
        for begin, end in spans:
            if end - begin not in sizes:
                sizes[end - begin] = len(block_header(built, begin, end)) + built.block_bytes(begin, end)
        if len(refs) != len(spans) or any(
                not block_id.match(ref.id) or ref.nbytes != sizes[end - begin]
                for ref, (begin, end) in zip(refs, spans)):
            raise CorruptEntry("a block list does not cover its tensors exactly")
        groups.append((built, refs))
    unplaced = {k for k, s in specs.items() if s.rows and _size(s.shape)} - placed
    if unplaced:
        raise CorruptEntry(f"tensors in no block group: {sorted(unplaced)[:3]}")
    return Manifest(fields=fields, layers=tuple(layers), groups=tuple(groups),
                    block_rows=block_rows, digests=_digests(fields, groups))


def _digests(fields: dict[str, Any], groups: list[tuple[Group, tuple[BlockRef, ...]]]
             ) -> tuple[int, ...] | None:
    """The manifest's device digests in group order; None if it has none of a known scheme.

    :raises CorruptEntry: a scheme this reader knows, with a list that does not fit."""
    if fields.get("device_digest") != digest.SCHEME:
        return None
    found = []
    for group, (built, _refs) in zip(fields["groups"], groups):
        listed = group["digests"]
        if not isinstance(listed, list) or len(listed) != len(built.tensors) or not all(
                isinstance(d, str) and _DIGEST.match(d) for d in listed):
            raise CorruptEntry("a block group's device digests do not fit its tensors")
        found.extend(int(d, 16) for d in listed)
    return tuple(found)


def _size(shape: tuple[int, ...]) -> int:
    total = 1
    for s in shape:
        total *= s
    return total
