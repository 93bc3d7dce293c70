"""``check_storage_layout`` kills a writer part way through a write: a layout that publishes
atomically passes (tests/cache/test_layout_conformance.py runs both built-in layouts), one
that writes where readers look fails, and the writer stops for good where it was told."""

from __future__ import annotations

import os
import time

import pytest

from foretell.plugin.testing import _StoppedWrite, check_storage_layout
from foretell.store import format as fmt
from foretell.store.files import make_directories
from foretell.store.single_file import SingleFileLayout


class InPlaceLayout(SingleFileLayout):
    """Writes an entry's file where readers look for it, truncating the one there: a writer
    that dies part way leaves neither the old version nor the new one."""

    def write(self, entry):
        path = self.path(self.key_for(entry.tokens, entry.namespace))
        make_directories(self.directory)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fmt.EntryWriter(entry, self.identity, created_at=time.time()).write_to(fd)
        finally:
            os.close(fd)
        self._index = None  # the next headers() scans
        return True


def test_a_layout_that_publishes_in_place_fails_the_killed_writer_check(tmp_path):
    with pytest.raises(AssertionError, match=r"a rewrite of a stored entry killed at line "
                                             r"\d+ of \d+ \(.*\): the entry stored before"):
        check_storage_layout(lambda identity: InPlaceLayout(tmp_path, identity=identity))


def test_the_same_layout_passes_every_other_check_it_is_put_to(tmp_path, monkeypatch):
    from foretell.plugin import testing

    calls = []
    monkeypatch.setattr(testing, "check_killed_writer", lambda *a, **k: calls.append(a))
    check_storage_layout(lambda identity: InPlaceLayout(tmp_path, identity=identity))
    assert len(calls) == 1


class TwoFiles:
    """A stand-in layout whose write is two lines, each leaving a file."""

    def __init__(self, folder):
        self.folder = folder

    def write(self, entry):
        (self.folder / "first").write_text(entry)
        (self.folder / "second").write_text(entry)
        return True


def test_a_stopped_writer_runs_no_further_line_until_unwound(tmp_path):
    packages = {__name__.partition(".")[0]}
    whole = _StoppedWrite(TwoFiles(tmp_path), "x", packages, stop=0)
    assert not whole.stopped and whole.lines == 3
    (tmp_path / "first").unlink()
    (tmp_path / "second").unlink()

    writer = _StoppedWrite(TwoFiles(tmp_path), "x", packages, stop=2)
    assert writer.stopped and "in write()" in writer.at
    assert (tmp_path / "first").exists() and not (tmp_path / "second").exists()
    writer.unwind()
    assert not (tmp_path / "second").exists()
