"""docs/environment.md lists every FORETELL_* variable the code reads: a variable added
without a line there fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Names that look like variables but are not read from the environment.
NOT_VARIABLES = {"FORETELL_PLUGIN_API"}  # a plugin module's attribute (hookspecs.py)


def variables_read() -> set[str]:
    found = set()
    for folder in ("core", "plugins", "contrib"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"[\"'](FORETELL_[A-Z_]+)[\"']", path.read_text("utf-8")))
    return found - NOT_VARIABLES


def test_every_variable_the_code_reads_is_documented():
    documented = set(re.findall(r"^\| `(FORETELL_[A-Z_]+)`",
                                (ROOT / "docs" / "environment.md").read_text("utf-8"), re.M))
    read = variables_read()
    assert {"FORETELL_DEBUG", "FORETELL_BLAS"} <= read  # the scan finds them (none if the layout moved)
    assert sorted(read - documented) == []
    assert sorted(documented - read) == []  # and lists none that is gone
