import json
import sys
from pathlib import Path

import pytest

# importable without installation, as on the GPU host (PYTHONPATH=contrib/foretell-demo-train)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:  # foretell is optional here; where it is installed, its engine runs in these tests
    from foretell.platform import blas
except ImportError:
    pass
else:
    # Bound before any test imports mlx, as foretell.load() would: else a run of this folder
    # alone (.ci/run's) drafts on MLX's reference BLAS and warns (docs/blas.md).
    blas.preload()


@pytest.fixture(scope="session")
def produced(tmp_path_factory):
    """The tiny family, trained end to end on the stdlib alone (fast); shared by the smoke
    and redraft tests. Skips where torch is not installed."""
    pytest.importorskip("torch", reason="the demo trainer needs PyTorch, which the [test] extra leaves out")
    pytest.importorskip("tokenizers")
    from foretell_demo_train.cli import main

    root = tmp_path_factory.mktemp("demo")
    main(["run", "--preset", "tiny", "--work", str(root / "work"), "--out", str(root / "out"),
          "--roots", stdlib_root(), "--pack-dir", str(root / "pack")])
    return root


@pytest.fixture(scope="session")
def stdlib() -> str:
    """The standard library's directory: a corpus root every machine has."""
    return stdlib_root()


def stdlib_root() -> str:
    return str(Path(json.__file__).resolve().parent.parent)
