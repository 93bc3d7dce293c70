"""Sphinx configuration of foretell's docs site (``python -m sphinx -W -b html docs OUT``).

The pages are the Markdown files beside this one (MyST); the references are generated from
the code's docstrings (autodoc), so they cannot drift from it.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The checkout's packages, so autodoc documents this tree even where foretell is not installed.
sys.path[:0] = [str(ROOT / "core"), str(ROOT / "plugins")]

project = "foretell"
author = "the foretell authors"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
root_doc = "index"
myst_heading_anchors = 4  # pages link to each other's sections as GitHub renders them
myst_enable_extensions = ["colon_fence"]
exclude_patterns = [
    "_build",
    # Machine-written figures (JSON, JSONL) and the demo model's data: linked as files of
    # the repository, not pages of the site.
    "bench-data/*.json*",
    "demo-models",
]
suppress_warnings = [
    # Links to files outside docs/ (../benchmarks/README.md, source files, bench-data JSON)
    # name files of the repository; they are not pages of the site and stay plain links.
    "myst.xref_missing",
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
html_theme = "alabaster"
html_title = "foretell"
