"""A block store on a read-only file system: the tier opens over it, serves what it holds,
fails every write and says so with one warning for the whole run (the collect as the tier
opens and closes, and each write, all meet the same outage)."""

from __future__ import annotations

import errno
import logging
import os

from blockfill import kv_of

from foretell.cache.tier import CacheTier
from foretell_blockstore.layout import BlockStoreConfig, BlockStoreLayout

WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT


def read_only(monkeypatch, root) -> None:
    """Every call that would change something under ``root`` fails as on a read-only mount."""
    root = str(root)

    def refusing(real, writes=None):
        def call(path, *args, **kwargs):
            if (isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(root)
                    and (writes is None or writes(*args, **kwargs))):
                raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refusing(os.open, lambda flags, *_a, **_k: flags & WRITES))
    for name in ("mkdir", "unlink", "utime", "replace", "rename"):
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


def test_a_read_only_block_store_warns_once_per_run(tmp_path, codecs, identity, monkeypatch,
                                                    caplog):
    def layout():
        return BlockStoreLayout(tmp_path, BlockStoreConfig(block_tokens=4), identity=identity)

    writer = CacheTier(codecs, layout=layout())
    writer.store(range(10), kv_of(list(range(10))))
    assert writer.close(10).durable
    read_only(monkeypatch, tmp_path)
    with caplog.at_level(logging.DEBUG, logger="foretell"):
        tier = CacheTier(codecs, layout=layout())
        assert tier.lookup([*range(10), 99]).tier == "ssd"  # what it holds is served
        tier.store(range(20), kv_of(list(range(20))))
        tier.store(range(30, 45), kv_of(list(range(30, 45))))
        report = tier.close(10)
    assert not report.durable and report.failed == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "Read-only file system" in warnings[0], warnings
