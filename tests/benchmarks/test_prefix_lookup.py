"""``benchmarks/prefix_lookup.py`` times each lookup kind both ways on the same cache and
reports what served it, which both ways agreed on."""

from __future__ import annotations

import pytest
from benchscript import load

prefix_lookup = load("prefix_lookup")


@pytest.mark.parametrize("flags, last", [([], "exact"), (["--ssd"], "covers")])
def test_the_lookup_benchmark_reports_every_kind_at_every_size(capsys, flags, last):
    """RAM (``exact`` last) and, with ``--ssd``, the SSD index (``covers`` last)."""
    assert prefix_lookup.main([*flags, "--entries", "4,40", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [(int(r[0]), r[1], int(r[4])) for r in rows] == [
        (count, kind, served) for count in (4, 40)
        for kind, served in [("new", 0), ("system", 32), ("sys-late", 32),
                             ("follow-up", 192), (last, 0)]]
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows)
