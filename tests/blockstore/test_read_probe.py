"""The read probe (``python -m foretell_blockstore.read_probe``) runs end to end on a tiny
entry and reports every pool size and both hash-call sizes; it leaves the store's own read
pool as it found it."""

from __future__ import annotations

from foretell.store import format as fmt
from foretell_blockstore import read_probe


def test_the_read_probe_reports_each_pool_and_call_size(capsys):
    pool = fmt.io_pool()
    read_probe.main(["--layers", "2", "--tokens", "1024", "--heads", "2", "--dim", "16",
                     "--turns", "1"])
    out = capsys.readouterr().out
    for workers in (1, 2, 4, 8, 16):
        assert f"read pool {workers:2d}: unverified" in out
    assert "in 128 KiB calls" in out and "in 1024 KiB calls" in out
    # It checks what it serves, and times a read in fresh processes by phase.
    assert "served exactly what was written: True" in out
    assert out.count("fresh-process verified read: buffers") == 3
    assert fmt.io_pool() is pool
