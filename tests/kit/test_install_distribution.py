"""foretell.plugin.testing.install_distribution: a plugin's source tree installed for real
into a directory of its own, or a clear failure naming the source."""

from __future__ import annotations

from pathlib import Path

import pytest

from foretell.plugin.testing import install_distribution

NGRAM = Path(__file__).resolve().parents[2] / "contrib" / "foretell-ngram"


def test_a_plugin_installs_with_its_entry_point_and_leaves_its_source_as_it_was(tmp_path):
    before = sorted(p.name for p in NGRAM.iterdir())
    site = install_distribution(NGRAM, tmp_path)
    (info,) = site.glob("foretell_ngram-*.dist-info")
    assert "foretell.plugins" in (info / "entry_points.txt").read_text()
    assert (site / "foretell_ngram" / "lookup.py").is_file()
    assert sorted(p.name for p in NGRAM.iterdir()) == before  # no .egg-info left beside it


def test_a_directory_that_is_no_distribution_fails_naming_it(tmp_path):
    source = tmp_path / "not-a-plugin"
    source.mkdir()
    (source / "README").write_text("nothing to build\n")
    with pytest.raises(RuntimeError, match=r"installing .*not-a-plugin for the tests failed"):
        install_distribution(source, tmp_path / "out")
