"""On a CPU no CUDA-only module is imported: foretell's CUDA code lives in one package,
``foretell.platform.cuda``, which engine code reaches only through
``foretell.platform.device.cuda_backend()``, at run time, and which that answers only where
MLX computes on a CUDA GPU (docs/decisions.md, "CUDA-only code")."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CUDA = "foretell.platform.cuda"

#: A CPU `foretell run` of the shipped demo, twice over one cache directory (the second
#: restores what the first stored, through the block store), then what the process holds:
#: the CUDA package's modules, and any library of CUDA's it opened.
RUN = f"""
import ctypes, json, sys

opened = []
class Recording(ctypes.CDLL):
    def __init__(self, name, *args, **kwargs):
        opened.append(str(name))
        super().__init__(name, *args, **kwargs)
ctypes.CDLL = Recording

from foretell.platform import blas
blas.preload()
import mlx.core as mx
mx.set_default_device(mx.cpu)  # a CPU run, on a CUDA host too

from foretell.cli import main
for _ in range(2):
    assert main(["run", "--max-tokens", "4", "-p", "Hello", "--json",
                 "--cache-dir", sys.argv[1]]) == 0
try:
    with open("/proc/self/maps") as maps:
        mapped = sorted({{line.split()[-1] for line in maps if "libcuda" in line}})
except OSError:
    mapped = []
print(json.dumps({{
    "modules": sorted(m for m in sys.modules if m == "{CUDA}" or m.startswith("{CUDA}.")),
    "opened": [name for name in opened if "cuda" in name or "nvrtc" in name],
    "mapped": mapped if not mx.cuda.is_available() else [],  # MLX's CUDA build links it
}}))
"""


def test_a_cpu_foretell_run_imports_no_cuda_module(tmp_path):
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "kv")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    stats = [json.loads(line) for line in lines[:-1] if '"type": "stats"' in line]
    assert [s["cached_from"] for s in stats] == [None, "ssd"]  # the block store's paths ran
    assert json.loads(lines[-1]) == {"modules": [], "opened": [], "mapped": []}


def _runtime_imports(path: Path) -> set[str]:
    """The modules ``path`` imports when it runs, at any depth (``if TYPE_CHECKING:``
    blocks left out): ``from a.b import c`` counts as ``a.b`` and ``a.b.c``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for orelse in child.orelse:
                    visit(orelse)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.add(child.module)
                found.update(f"{child.module}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                found.update(alias.name for alias in child.names)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def test_only_the_seam_imports_the_cuda_package():
    """Outside the package itself, only ``device.cuda_backend`` imports it: engine code and
    plugins take what it answers, so none can import it on a CPU by accident."""
    package = ROOT / "core" / "foretell" / "platform" / "cuda"
    sources = [p for top in ("core", "plugins") for p in (ROOT / top).rglob("*.py")
               if package not in p.parents and "build" not in p.parts]
    assert len(sources) > 50
    importers = {
        str(path.relative_to(ROOT)) for path in sources
        if any(m == CUDA or m.startswith(f"{CUDA}.") for m in _runtime_imports(path))
    }
    assert importers == {"core/foretell/platform/device.py"}


def test_the_seam_answers_the_package_only_on_a_cuda_gpu(monkeypatch):
    from foretell.platform import device

    monkeypatch.setattr(device, "on_cuda", lambda: False)
    assert device.cuda_backend() is None
    monkeypatch.setattr(device, "on_cuda", lambda: True)
    backend = device.cuda_backend()
    assert backend is not None and backend.__name__ == CUDA
    assert {"driver", "areas", "nvrtc", "kernels"} <= set(vars(backend))
