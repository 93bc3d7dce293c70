"""The training corpus: Python sources every machine has (stdlib + installed packages).

Files are found under the interpreter's ``sysconfig`` paths and ``site.getsitepackages()``,
deduplicated by real path and by content, sorted by path, and split by file: every
``heldout_every``-th file (in sorted order) is held out and never trained on.
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

MAX_FILE_BYTES = 1_000_000


@dataclass
class Corpus:
    roots: list[str]
    train: list[tuple[str, int]] = field(default_factory=list)
    heldout: list[tuple[str, int]] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "roots": self.roots,
            "train_files": len(self.train),
            "train_bytes": sum(s for _, s in self.train),
            "heldout_files": len(self.heldout),
            "heldout_bytes": sum(s for _, s in self.heldout),
            "skipped": dict(self.skipped),
            "max_file_bytes": MAX_FILE_BYTES,
        }

    def write_manifest(self, path: Path) -> None:
        lines = ["# split\tbytes\tpath  (sorted; held-out = every Nth file)"]
        entries = [("train", p, s) for p, s in self.train] + [
            ("heldout", p, s) for p, s in self.heldout
        ]
        entries.sort(key=lambda e: e[1])
        lines += [f"{split}\t{size}\t{p}" for split, p, size in entries]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def source_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    try:
        roots += site.getsitepackages()
    except AttributeError:  # some virtualenv flavours lack it
        pass
    out: list[str] = []
    for r in roots:
        rp = os.path.realpath(r)
        if os.path.isdir(rp) and rp not in out:
            out.append(rp)
    return out


def _walk_py(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def collect(
    roots: list[str] | None = None,
    heldout_every: int = 20,
    max_files: int | None = None,
    exclude: tuple[str, ...] = (),
) -> Corpus:
    """Find, filter and split the corpus. ``max_files`` keeps a deterministic spread
    (every k-th path of the sorted list, before filtering) for small test runs."""
    roots = roots or source_roots()
    corpus = Corpus(roots=roots)
    skipped = {"too_large": 0, "not_utf8": 0, "empty": 0, "duplicate": 0, "excluded": 0}
    paths = set()
    for root in roots:
        for p in _walk_py(root):
            paths.add(os.path.realpath(p))
    ordered = sorted(paths)
    if max_files and len(ordered) > max_files:
        # deterministic spread for small runs (before reading anything)
        step = len(ordered) / max_files
        ordered = [ordered[int(i * step)] for i in range(max_files)]
    excl = tuple(os.path.realpath(e) for e in exclude)
    seen: set[str] = set()
    kept: list[tuple[str, int]] = []
    for p in ordered:
        if excl and p.startswith(excl):
            skipped["excluded"] += 1
            continue
        try:
            size = os.path.getsize(p)
        except OSError:
            continue
        if size > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            continue
        if size == 0:
            skipped["empty"] += 1
            continue
        raw = Path(p).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if not text.strip():
            skipped["empty"] += 1
            continue
        digest = hashlib.sha1(raw).hexdigest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        kept.append((p, size))
    for i, entry in enumerate(kept):
        (corpus.heldout if i % heldout_every == heldout_every - 1 else corpus.train).append(entry)
    corpus.skipped = skipped
    return corpus


def read_text(path: str) -> str:
    return Path(path).read_text(encoding="utf-8")
