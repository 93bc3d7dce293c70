"""Pack the shippable output into at most 8 files of at most 15 MiB (the GPU host's return
channel takes 8 files of <= 16 MiB per call): one gzip'd tar, split into parts.

Reassemble with ``python -m foretell_demo_train unpack`` or
``cat foretell-demo.tar.gz.part* | tar xz -C DEST``.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

SHIPPED = ["demo", "demo-draft", "demo-gemma", "quality.json", "manifest.txt"]
PART_BYTES = 15 * 1024 * 1024
MAX_PARTS = 8
STEM = "foretell-demo.tar.gz"


def pack(out: Path, pack_dir: Path, log=print, names: list[str] = SHIPPED) -> list[Path]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for name in names:
            p = out / name
            if not p.exists():
                raise FileNotFoundError(f"{p} is missing; run the export stage first")
            tar.add(p, arcname=name, recursive=True)
    data = buf.getvalue()
    n = -(-len(data) // PART_BYTES)
    if n > MAX_PARTS:
        raise RuntimeError(f"packed output is {len(data)} bytes: more than {MAX_PARTS} parts")
    pack_dir.mkdir(parents=True, exist_ok=True)
    for old in pack_dir.glob(STEM + ".part*"):
        old.unlink()
    parts = []
    for i in range(n):
        p = pack_dir / f"{STEM}.part{i:02d}"
        p.write_bytes(data[i * PART_BYTES : (i + 1) * PART_BYTES])
        parts.append(p)
    log(f"[pack] {len(data) / 2**20:.2f} MiB in {n} part(s) under {pack_dir}")
    return parts


def unpack(pack_dir: Path, dest: Path, log=print) -> None:
    parts = sorted(pack_dir.glob(STEM + ".part*"))
    if not parts:
        raise FileNotFoundError(f"no {STEM}.part* under {pack_dir}")
    data = b"".join(p.read_bytes() for p in parts)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    log(f"[unpack] {len(parts)} part(s) -> {dest}")
