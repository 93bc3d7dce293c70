"""Crash safety: a writer killed with SIGKILL at random moments, 60 times, never leaves an
entry that is served unverified; interrupted writes are reaped; every surviving entry
restores exactly. And a directory full of damaged, foreign and future files serves none
of them, crashes nothing, and warns once per damaged file."""

from __future__ import annotations

import logging
import os
import random
import signal
import struct
import time

import attrs
import mlx.core as mx
import numpy as np
import pytest
from cachefill import filled_kv, filled_rotating

from foretell.cache.codecs import restore_caches, snapshot_entry
from foretell.cache.tier import CacheTier
from foretell.store.single_file import SingleFileConfig, SingleFileLayout

KILLS = 60


def entries(codecs, count=6):
    made = []
    for i in range(count):
        n = 8 + 4 * i
        caches = [filled_kv(n + i), filled_rotating(n, max_size=12)]
        caches[0].trim(i)
        entry = snapshot_entry(range(100 * i, 100 * i + n), caches, codecs)
        mx.eval([t for layer in entry.layers for t in layer.tensors.values()])
        made.append(entry)
    return made


def write_forever(root, identity, batch) -> None:
    """The child: rewrite the entries in a loop until killed."""
    layout = SingleFileLayout(root, identity=identity)
    while True:
        for entry in batch:
            layout.write(entry)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_writer_killed_at_random_moments_never_leaves_a_servable_bad_entry(
        tmp_path, identity, codecs):
    batch = entries(codecs)
    expected = {SingleFileLayout(tmp_path, identity=identity).key_for(e.tokens): e for e in batch}
    rng = random.Random(1234)
    orphans_seen = 0
    for _ in range(KILLS):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            try:
                write_forever(tmp_path, identity, batch)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        layout = SingleFileLayout(tmp_path, SingleFileConfig(orphan_age_s=0), identity=identity)
        orphans_seen += len(list(layout.directory.glob("*.tmp"))) if layout.directory.exists() else 0
        for header in layout.scan():
            entry = layout.read(header.key)
            assert entry is not None, "an indexed entry failed verification"
            want = expected[header.key]
            for got, ref in zip(restore_caches(entry, codecs), restore_caches(want, codecs)):
                assert got.offset == ref.offset
                for a, b in zip(got.state, ref.state):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if layout.directory.exists():
            assert not list(layout.directory.glob("*.tmp")), "interrupted writes not reaped"
    assert orphans_seen > 0, "no kill landed mid-write: the test did not test anything"


def flip(path, offset_from_end=3):
    raw = bytearray(path.read_bytes())
    raw[-offset_from_end] ^= 0x10
    path.write_bytes(bytes(raw))


def test_damaged_foreign_and_future_files_are_never_served_and_never_crash(
        tmp_path, identity, codecs, caplog):
    good = SingleFileLayout(tmp_path, identity=identity)
    batch = entries(codecs, count=6)
    for entry in batch:
        assert good.write(entry)
    paths = [good.path(good.key_for(e.tokens)) for e in batch]
    flip(paths[0])                                            # a bit flipped in a tensor
    paths[1].write_bytes(paths[1].read_bytes()[:-40])         # truncated
    paths[2].write_bytes(b"\x00" * 50)                        # garbage
    raw = paths[3].read_bytes()                               # a future format version
    paths[3].write_bytes(raw.replace(b'"foretell.format_version":"2"',
                                     b'"foretell.format_version":"9"', 1))
    foreign = SingleFileLayout(tmp_path, identity=attrs.evolve(identity, model_id="other/model"))
    assert foreign.write(batch[4])                              # another model's entry...
    os.replace(foreign.path(foreign.key_for(batch[4].tokens)), paths[4])  # ...under our name
    header_len = struct.unpack("<Q", paths[5].read_bytes()[:8])[0]
    flip(paths[5], offset_from_end=len(paths[5].read_bytes()) - 8 - header_len // 2)  # header

    with caplog.at_level(logging.WARNING):
        tier = CacheTier(codecs, layout=SingleFileLayout(tmp_path, identity=identity))
        for entry in batch:
            assert tier.lookup([*entry.tokens, 1]).tier is None
        again = CacheTier(codecs, layout=SingleFileLayout(tmp_path, identity=identity))
        assert again.ssd.entries() == []
    corrupt_warnings = [r for r in caplog.records if "corrupt" in r.message]
    assert len(corrupt_warnings) == 4  # flipped, truncated, garbage, damaged header: once each
    assert paths[3].exists() and paths[4].exists()  # a future version and a foreign file: kept
