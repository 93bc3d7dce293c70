"""What every storage layout does with files: durable writes and directories, bounded
reads of regular files only, quiet deletes that never leave the cache root, one warning
per I/O outage, and the incremental re-read of a directory of entry files. Shared by the
single-file layout here and by the block store plugin.

Imported when plugins register: the standard library and foretell's errors only.
"""

from __future__ import annotations

import logging
import os
import stat as st
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from foretell.errors import CorruptEntry, NotAFile

log = logging.getLogger("foretell.store")


def _kind(mode: int) -> str:
    for test, name in ((st.S_ISFIFO, "a FIFO"), (st.S_ISDIR, "a directory"),
                       (st.S_ISCHR, "a character device"), (st.S_ISBLK, "a block device"),
                       (st.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "of another kind"


def not_a_file(mode: int) -> str | None:
    """Why a file of this ``st_mode`` is passed over (:class:`NotAFile`), or None for a
    regular file."""
    return None if st.S_ISREG(mode) else f"not a regular file ({_kind(mode)})"


def _open_if_regular(path: str, flags: int) -> int:
    # O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer, forever.
    fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0))
    try:
        why = not_a_file(os.fstat(fd).st_mode)
        if why is not None:
            raise NotAFile(why)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file (through a symbolic link
    too); its ``name`` is the path. What a layout opens an untrusted file with.

    :raises NotAFile: a FIFO, device, directory or socket (checked on the open descriptor,
        so nothing swapped in after a check is read).
    :raises OSError: as ``open``."""
    return open(path, "rb", opener=_open_if_regular)  # noqa: SIM115 - the caller closes it


def read_bounded(path: str | Path, limit: int, what: str = "a cache file") -> bytes:
    """The whole of regular file ``path`` if it holds at most ``limit`` bytes. The size is
    checked before anything is allocated and at most ``limit + 1`` bytes are read, so a
    file truncated out to gigabytes (sparse, costing no disk) costs a ``stat``.

    :raises CorruptEntry: larger than ``limit`` (``what`` names what it should have been).
    :raises NotAFile: see :func:`open_regular`. :raises OSError: as ``open``."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise CorruptEntry(f"{size} bytes, more than {what} holds ({limit} at most)")
        data = fh.read(limit + 1)
    if len(data) > limit:  # grew while it was read
        raise CorruptEntry(f"more than {limit} bytes, more than {what} holds")
    return data


def outside_root(root: str | Path, *folders: str | Path) -> tuple[Path, str] | None:
    """The first of ``folders`` that resolves (symbolic links followed) to a place outside
    ``root`` as it resolves, with that place; None when every one lies inside."""
    top = os.path.realpath(root)
    for folder in folders:
        real = os.path.realpath(folder)
        if os.path.commonpath([top, real]) != top:
            return Path(folder), real
    return None


class RootGuard:
    """Whether a layout may write and delete in its folders: only while they lie inside
    its cache root. A fingerprint directory that is a symbolic link to elsewhere had that
    place's files deleted as corrupt entries and interrupted writes; now nothing there is
    deleted, nor written (what could not be evicted would outgrow the cap), with one
    warning per layout. Reads go on: they verify every byte wherever it lies."""

    def __init__(self, root: str | Path, *folders: str | Path):
        self.root = Path(root)
        self.folders = folders
        self._warned = False

    def allows(self) -> bool:
        found = outside_root(self.root, *self.folders)
        if found is None:
            return True
        folder, real = found
        log.log(logging.DEBUG if self._warned else logging.WARNING,
                "cache directory %s leads outside the cache root %s (to %s): foretell "
                "writes and deletes nothing there; remove the link to cache there again",
                folder, self.root, real)
        self._warned = True
        return False


#: What tells a scan that a file changed: inode, size, mtime (ns).
FileVersion = tuple[int, int, int]
#: What a scan made of one entry file: its version then, and its index entry or why it is
#: passed over.
Scanned = tuple[FileVersion, Any]


def file_version(stat: os.stat_result) -> FileVersion:
    """A file's :data:`FileVersion`. Entries are never rewritten in place (a rewrite renames
    a new inode over the name), so an unchanged version means the bytes parsed before; an
    edit in place that restores the time is no such rewrite, and reads, which verify every
    byte, still catch it."""
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def log_io_failure(exc: OSError, action: str, *, warned: bool) -> bool:
    """Log a cache I/O failure: a warning for the first of an outage, debug level after
    that until a write succeeds (invariant 9). Returns True (the outage has been warned of)."""
    if warned:
        log.debug("cannot %s: %s", action, exc)
    elif action.startswith("delete"):
        log.warning("cannot %s: %s (read-only or unwritable?); it stays on disk. Further "
                    "failures are logged at debug level until a write succeeds.", action,
                    exc.strerror or exc)
    else:
        log.warning("cannot %s: %s (disk full or unwritable?). Cache entries are not being "
                    "persisted; generation continues. Further failures are logged at debug "
                    "level until a write succeeds.", action, exc.strerror or exc)
    return True


def full_fsync(fd: int) -> None:
    # macOS's fsync leaves data in the drive's cache; F_FULLFSYNC is what makes it durable.
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    except (ImportError, AttributeError, OSError):
        os.fsync(fd)


def fsync_directory(path: Path) -> None:
    """Make the names in directory ``path`` durable (what a rename into it needs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        full_fsync(fd)
    finally:
        os.close(fd)


def make_directories(path: Path) -> None:
    """``path`` and its missing parents created, each new one's name made durable in its
    parent: an entry written into a directory created for it is durable only then. One
    thread at a time, so a writer never finds a directory another thread has created but
    not yet made durable (another process's, at the first writes to a fresh root, can)."""
    with _MAKING_DIRECTORIES:
        missing = []
        while not path.is_dir():
            missing.append(path)
            path = path.parent
        for directory in reversed(missing):
            directory.mkdir(exist_ok=True)
            fsync_directory(directory.parent)


_MAKING_DIRECTORIES = threading.Lock()


def unlink_quietly(path: Path) -> bool:
    """Delete ``path``; False (and nothing raised) if it could not be."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def rescan(folder: Path, names: Iterable[str], suffix: str, known: dict[str, Scanned],
           read: Callable[[str, FileVersion], Scanned | None]
           ) -> tuple[dict[str, Any], dict[str, Scanned], dict[str, str]]:
    """One pass over the entry files (``suffix``) among ``names`` in ``folder``: a file whose
    :func:`file_version` is the one in ``known`` keeps what it was read to; any other is
    ``read(key, version)`` (None: not usable, left out), unless it is not a regular file
    (a FIFO, a directory...: passed over unread, :class:`NotAFile`). Returns the index
    entries by key, the new ``known`` by file name, and the passed-over files (path ->
    why): a re-read of a directory of unchanged entries costs a ``stat`` each."""
    found: dict[str, Any] = {}
    scanned: dict[str, Scanned] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if not name.endswith(suffix):
            continue
        key, path = name[: -len(suffix)], folder / name
        try:
            stat = os.stat(path)
        except OSError:
            continue  # removed meanwhile
        version = file_version(stat)
        entry = known.get(name)
        if entry is None or entry[0] != version:
            why = not_a_file(stat.st_mode)
            entry = (version, why) if why is not None else read(key, version)
            if entry is None:
                continue
        scanned[name] = entry
        if isinstance(entry[1], str):
            skipped[str(path)] = entry[1]
        else:
            found[key] = entry[1]
    return found, scanned, skipped
