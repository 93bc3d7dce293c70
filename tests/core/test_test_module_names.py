"""Every test module's file name is unique across tests/ and contrib/: pytest's default
import mode imports test modules by basename, so a second `test_cli.py` stops the README's
test command at collection."""

from __future__ import annotations

import collections
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_two_test_modules_share_a_file_name():
    seen = collections.defaultdict(list)
    for folder in ("tests", "contrib"):
        for path in (ROOT / folder).rglob("test_*.py"):
            if "templates" not in path.parts:
                seen[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
