"""A block read from the server into the tensors it holds: checked (size, header, checksum)
as its pieces are copied into MLX-owned buffers, the way the block store checks a block file
(``foretell_blockstore.blockfile``), from a value in memory instead of a file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from foretell.store import format as fmt
from foretell.store.entry import LayerState
from foretell.store.reserve import BufferReserve
from foretell_blockstore import manifest as mf
from foretell_blockstore.blockfile import BadBlock


def assemble(manifest: mf.Manifest, values: Sequence[bytes | None], *, verify: bool = True,
             reserve: BufferReserve | None = None) -> list[LayerState]:
    """The entry's layers from its blocks' values (in ``manifest.blocks`` order), each block
    checked (its size, its header, and with ``verify`` its checksum) as its pieces are
    copied into MLX-owned buffers (taken from ``reserve`` where it holds enough, so they are
    not zero-filled first: ``mf.host_buffers``); every check passes before anything is
    returned.

    :raises BadBlock: a block missing, of another size or header, or failing its checksum.
    """

    specs = manifest.specs
    buffers = dict(zip(((s.layer, s.name) for s in specs),
                       mf.host_buffers(specs, reserve=reserve)))
    at = 0
    for group, refs in manifest.groups:
        for ref, (begin, end) in zip(refs, group.spans(manifest.block_rows)):
            place_block(values[at], ref, group, begin, end, buffers, verify)
            at += 1
    return mf.layer_states(manifest, buffers)


def place_block(value: bytes | None, ref: mf.BlockRef, group: mf.Group, begin: int, end: int,
                buffers: dict[tuple[int, str], Any], verify: bool) -> None:
    """Copy one block's pieces (rows ``[begin, end)`` of each tensor of ``group``) into the
    tensors' buffers (``mf.host_buffers``), checking its size and header first and, with
    ``verify``, each piece's checksum over the bytes copied (``mf.block_checksum``).

    :raises BadBlock: missing, of another size or header, or failing its checksum."""
    if value is None:
        raise BadBlock(ref.id, f"block {ref.id[:16]} is missing (evicted by the server?)")
    if len(value) != ref.nbytes:
        raise BadBlock(ref.id, f"block {ref.id[:16]} has the wrong size")
    header = mf.block_header(group, begin, end)
    view = memoryview(value)
    if view[:len(header)] != header:
        raise BadBlock(ref.id, f"block {ref.id[:16]} has another header")
    at, checksums = len(header), []
    for spec in group.tensors:
        size = spec.piece_bytes(begin, end)
        piece = np.frombuffer(view, dtype=np.uint8, count=size, offset=at)
        if verify:
            checksums.append(fmt.checksum(view[at:at + size]))
        flat = np.frombuffer(buffers[(spec.layer, spec.name)][1], dtype=np.uint8)
        if len(spec.shape) < 2:
            flat[:] = piece
        else:
            leads = 1
            for dim in spec.shape[:-2]:
                leads *= dim
            width = spec.row_bytes() // leads
            flat.reshape(leads, spec.rows, width)[:, begin:end, :] = piece.reshape(
                leads, end - begin, width)
        at += size
    if verify and mf.block_checksum(checksums) != ref.checksum:
        raise BadBlock(ref.id, f"block {ref.id[:16]} fails its checksum")
