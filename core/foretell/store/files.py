"""What every storage layout does with files: durable writes and directories, quiet
deletes, one warning per I/O outage, and the incremental re-read of a directory of entry
files. Shared by the single-file layout here and by the block store plugin.

Imported when plugins register: the standard library only.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("foretell.store")

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
    ``read(key, version)`` (None: not usable, left out). Returns the index entries by key,
    the new ``known`` by file name, and the passed-over files (path -> why): a re-read of a
    directory of unchanged entries costs a ``stat`` each."""
    found: dict[str, Any] = {}
    scanned: dict[str, Scanned] = {}
    skipped: dict[str, str] = {}
    for name in names:
        if not name.endswith(suffix):
            continue
        key, path = name[: -len(suffix)], folder / name
        try:
            version = file_version(os.stat(path))
        except OSError:
            continue  # removed meanwhile
        entry = known.get(name)
        if entry is None or entry[0] != version:
            entry = read(key, version)
            if entry is None:
                continue
        scanned[name] = entry
        if isinstance(entry[1], str):
            skipped[str(path)] = entry[1]
        else:
            found[key] = entry[1]
    return found, scanned, skipped
