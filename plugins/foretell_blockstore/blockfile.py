"""One block file of the ``blocks`` layout: written durably, opened and checked against its
manifest, its pieces read into place (straight into their tensors, or on a CUDA GPU through a
staging slot or whole into a landing area), each piece hashed as it lands.

A block is ``header + pieces``: the header names the rows and tensors it holds
(``manifest.block_header``), each piece one tensor's rows, in file order. Every reader
checks the block's size and header before its bytes are used and, when asked, its
pieces' checksums against the manifest's before the read returns (:func:`checked_block`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foretell.store import format as fmt
from foretell.store.files import full_fsync, not_a_file
from foretell_blockstore import manifest as mf

if TYPE_CHECKING:
    from foretell.platform import cuda

#: iovecs per preadv call (POSIX guarantees at least 16; Linux and macOS allow 1024).
IOV_MAX = 1024


class BadBlock(Exception):
    """A block that cannot be served (missing, truncated, another size or header, failing
    its checksum): the layout drops the entry being read and deletes the block, which later
    writes of the same bytes would otherwise reuse."""

    def __init__(self, block_id: str, reason: str):
        super().__init__(reason)
        self.block_id = block_id
        self.reason = reason


def open_block(path: Path, ref: mf.BlockRef, header: bytes) -> tuple[int, int]:
    """A block's descriptor and the offset past its header, once its size and header are
    the ones its manifest implies (the caller closes it).

    :raises BadBlock: missing, not a regular file, of another size or another header.
    """
    try:
        # O_NONBLOCK: a FIFO named like a block would otherwise hold the open forever.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0)
                     | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise BadBlock(ref.id, f"block {ref.id[:16]} is missing") from None
    try:
        stat = os.fstat(fd)
        why = not_a_file(stat.st_mode)
        if why is not None:
            raise BadBlock(ref.id, f"block {ref.id[:16]} is {why}")
        os.set_blocking(fd, True)
        if stat.st_size != ref.nbytes:
            raise BadBlock(ref.id, f"block {ref.id[:16]} has the wrong size")
        seen = bytearray(len(header))
        offset = read_runs(fd, [memoryview(seen)], 0, ref)
        if seen != header:
            raise BadBlock(ref.id, f"block {ref.id[:16]} has another header")
    except BaseException:
        os.close(fd)
        raise
    return fd, offset


def read_block(path: Path, ref: mf.BlockRef, header: bytes,
               pieces: list[list[memoryview]], verify: bool = True,
               staging: Callable[[], cuda.driver.Staging] | None = None) -> None:
    """Read one block: its header must be the one its manifest implies; each piece's bytes go
    to its runs (``pieces``, in file order) and is checksummed right after its read, while
    still in the cache; together they must match the manifest's checksum. ``staging`` (a
    CUDA GPU's: ``foretell.platform.cuda.driver.staging``): consecutive pieces are read in
    one call into this thread's staging slot (up to a slot, :func:`slots`), each piece's
    copy into its runs is started (by DMA) and the piece hashed in one call while the
    copies run (no later read overwrites the slot before its copies have finished;
    a block that fails its checksum is never returned, whatever landed). Otherwise each
    piece is read straight into its runs and hashed there: reading several at once there
    made verified reads slower, the first pieces leaving the cache before they were hashed
    (docs/block-store.md, "Reads of 4 MiB").

    :raises BadBlock: missing, of another size, another header, or failing its checksum.
    :raises CudaCopyError: a copy to the GPU failed (the block is not at fault).
    """
    stage = staging() if staging is not None else None
    with checked_block(path, ref, header, verify, stage) as (fd, offset, checksums):
        if stage is None:
            for runs in pieces:
                offset = read_runs(fd, runs, offset, ref)
                if verify:
                    checksums.append(fmt.checksum(*runs))
            return
        destinations = iter(pieces)
        for _slot, views in slots(fd, offset, ref, [sum(r.nbytes for r in runs)
                                                     for runs in pieces], stage):
            for view in views:
                stage.send(view, next(destinations))  # the copies read it while it is hashed
            if verify:
                checksums.extend(fmt.checksum(view) for view in views)


def land_block(path: Path, ref: mf.BlockRef, header: bytes, sizes: list[int],
               verify: bool, address: int,
               staging: Callable[[], cuda.driver.Staging]) -> None:
    """Read one block's tensor bytes (its pieces of ``sizes``, in file order) to
    ``address`` in a landing area (``foretell.platform.cuda.areas.LandingArea``):
    consecutive pieces into this thread's staging slot (``staging()``) in one call, the slot
    copied there in one, each piece hashed while the copy runs; as :func:`read_block`
    otherwise.

    :raises BadBlock: as :func:`read_block`.
    :raises CudaCopyError: a copy to the GPU failed (the block is not at fault).
    """
    stage = staging()
    with checked_block(path, ref, header, verify, stage) as (fd, offset, checksums):
        for slot, views in slots(fd, offset, ref, sizes, stage):
            stage.send_to(slot, address)
            address += slot.nbytes
            if verify:
                checksums.extend(fmt.checksum(view) for view in views)


@contextlib.contextmanager
def checked_block(path: Path, ref: mf.BlockRef, header: bytes, verify: bool,
                  stage: cuda.driver.Staging | None) -> Iterator[tuple[int, int, list[str]]]:
    """A block opened for reading (:func:`open_block`): yields its descriptor, the offset
    past its header and a list for its pieces' checksums, in file order. Afterwards every
    copy ``stage`` started has landed and the file is closed, whatever happened; and if
    the read finished, ``verify`` checks the checksums against the manifest's.

    :raises BadBlock: as :func:`open_block`, or failing its checksum.
    """
    fd, offset = open_block(path, ref, header)
    checksums: list[str] = []
    try:
        yield fd, offset, checksums
    finally:
        try:
            if stage is not None:
                stage.finish()  # no copy may still be landing once the read has returned
        finally:
            os.close(fd)
    if verify and mf.block_checksum(checksums) != ref.checksum:
        raise BadBlock(ref.id, f"block {ref.id[:16]} fails its checksum")


def slots(fd: int, offset: int, ref: mf.BlockRef, sizes: list[int],
          stage: cuda.driver.Staging) -> Iterator[tuple[memoryview, list[memoryview]]]:
    """Consecutive pieces of ``sizes`` read from ``offset`` on, as many as fit one staging
    slot (``stage.SLOT_BYTES``; a larger piece alone) in one call: each slot with a view of
    each of its pieces (docs/block-store.md, "Reads of 4 MiB")."""
    for group in consecutive(sizes, sizes, stage.SLOT_BYTES):
        slot = stage.slot(sum(size for size, _same in group))
        offset = read_runs(fd, [slot], offset, ref)
        views, begin = [], 0
        for size, _same in group:
            views.append(slot[begin:begin + size])
            begin += size
        yield slot, views


def wait_in_order(jobs: list[Any]) -> None:
    """Wait for every job, then raise the first one's error (in submission order)."""
    futures.wait(jobs)
    for job in jobs:
        job.result()  # raises BadBlock for the first damaged block, in order


def consecutive(items: list[Any], sizes: list[int], limit: int, most: int | None = None
                ) -> Iterator[list[tuple[Any, int]]]:
    """``items`` with their ``sizes``, in order, cut into runs of at most ``limit`` bytes
    and ``most`` items (an item larger than ``limit`` alone): what one read into a staging
    slot, or one ``writev``, takes."""
    group: list[tuple[Any, int]] = []
    total = 0
    for item, size in zip(items, sizes):
        if group and (total + size > limit or len(group) == most):
            yield group
            group, total = [], 0
        group.append((item, size))
        total += size
    if group:
        yield group


def read_runs(fd: int, runs: list[memoryview], offset: int, ref: mf.BlockRef) -> int:
    """``preadv`` the file's bytes from ``offset`` into ``runs``; returns the next offset."""
    for start in range(0, len(runs), IOV_MAX):
        batch = runs[start:start + IOV_MAX]
        want = sum(v.nbytes for v in batch)
        if os.preadv(fd, batch, offset) != want:
            raise BadBlock(ref.id, f"block {ref.id[:16]} is truncated")
        offset += want
    return offset


def write_durably(path: Path, *chunks: Any) -> None:
    """Write ``chunks`` to a new file and fsync it, gathered into ``writev`` calls of about
    :data:`WRITEV_BYTES` (a block's 576 runs of the 4B shape were as many writes, each a
    hand-over of the GIL)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        views = [memoryview(chunk).cast("B") for chunk in chunks]
        for gathered in consecutive(views, [view.nbytes for view in views], WRITEV_BYTES,
                                     IOV_MAX):
            batch = [view for view, _size in gathered]
            written = os.writev(fd, batch)
            for view in batch:  # a short write (rare for files): the rest one at a time
                if written >= view.nbytes:
                    written -= view.nbytes
                    continue
                fmt.write_all(fd, view[written:])
                written = 0
        full_fsync(fd)
    finally:
        os.close(fd)


#: Bytes one ``writev`` of a block gathers (at least one chunk). On the 2-core EPYC, writing
#: the 4B shape's 604 MB entry (8 blocks of 576 runs of 128 KiB) in a fresh process took
#: 0.44-0.45 s the first time and 0.37-0.44 s after in calls of 1 MiB, 1.47-1.56 s and
#: 0.34-0.37 s in one call per block, 0.52-1.02 s and 0.45-0.59 s in one write per run.
WRITEV_BYTES = 1 << 20


def unlink_counting(path: Path) -> int:
    try:
        size = os.stat(path).st_size
        os.unlink(path)
        return size
    except OSError:
        return 0
