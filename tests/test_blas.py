"""The optimized BLAS foretell binds under MLX on Linux: loaded, correct, and switchable off.

Each case runs in a fresh interpreter: whether the preload happens depends on what the
process imported first, which pytest's own process has long since decided.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from foretell.platform import blas

linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the preload exists for MLX's Linux CPU wheel"
)

MATMUL_VS_NUMPY = """
import json
import foretell
foretell.load  # where the engine starts: the BLAS is bound here, before mlx is imported
import mlx.core as mx
import numpy as np
from foretell.platform import blas

rng = np.random.default_rng(0)
errors = []
for m in (1, 16, 300):
    a = rng.standard_normal((m, 257), dtype=np.float32)
    b = rng.standard_normal((257, 129), dtype=np.float32)
    got = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
    want = a.astype(np.float64) @ b.astype(np.float64)
    errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
print(json.dumps({"status": blas.STATUS.to_dict(), "errors": errors}))
"""


def run_python(code: str, **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != blas.ENV} | env
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@linux_only
def test_starting_the_engine_puts_openblas_under_mlx_and_matmul_matches_numpy():
    result = run_python(MATMUL_VS_NUMPY)
    assert result["status"]["loaded"], result["status"]["reason"]
    assert "openblas" in result["status"]["loaded"]
    assert result["status"]["threads"] == 1
    assert max(result["errors"]) < 1e-5


@linux_only
def test_openblas_thread_count_follows_openblas_num_threads():
    result = run_python(MATMUL_VS_NUMPY, OPENBLAS_NUM_THREADS="2")
    assert result["status"]["threads"] == 2
    assert max(result["errors"]) < 1e-5


@linux_only
def test_foretell_blas_reference_keeps_mlx_own_blas():
    result = run_python(MATMUL_VS_NUMPY, FORETELL_BLAS="reference")
    assert result["status"]["loaded"] is None
    assert result["status"]["reason"] == "FORETELL_BLAS=reference"
    assert max(result["errors"]) < 1e-5


@linux_only
def test_mlx_imported_first_is_reported_not_patched():
    result = run_python(
        "import mlx.core, json\n"
        "import foretell\n"
        "foretell.load\n"
        "from foretell.platform import blas\n"
        "print(json.dumps(blas.STATUS.to_dict()))"
    )
    assert result["loaded"] is None
    assert "mlx was imported before foretell" in result["reason"]


WARNINGS_FROM_TWO_LOADS = """
import json, warnings
{first}
import foretell
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    foretell.load("demo-draft")
    foretell.load("demo-draft")
print(json.dumps([[w.category.__name__, str(w.message), w.lineno] for w in caught]))
"""


@linux_only
def test_loading_on_the_cpu_after_mlx_was_imported_first_warns_once_at_the_callers_line():
    caught = run_python(WARNINGS_FROM_TWO_LOADS.format(first="import mlx.core"))
    assert len(caught) == 1
    category, message, line = caught[0]
    assert category == "SlowBlasWarning"
    assert "Call foretell.load() (or foretell.platform.blas.preload()) before importing mlx" in message
    assert line == 7  # the first foretell.load(...) line of the script


@linux_only
def test_no_warning_when_foretell_loads_before_mlx_is_imported():
    assert run_python(WARNINGS_FROM_TWO_LOADS.format(first="")) == []


@linux_only
@pytest.mark.parametrize("what", ["missing", "not a library"])
def test_a_named_library_that_cannot_be_used_is_an_error_naming_the_variable_and_path(
    tmp_path, what
):
    named = tmp_path / "libnothing.so"
    if what == "not a library":
        named.write_text("not an ELF file")
    env = {k: v for k, v in os.environ.items() if k != blas.ENV} | {blas.ENV: str(named)}
    api = subprocess.run(
        [sys.executable, "-c", "import foretell; foretell.load('demo-draft')"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert api.returncode == 1
    assert "foretell.errors.ConfigError: FORETELL_BLAS: " in api.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "foretell", "run", "--max-tokens", "1"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert cli.returncode == 1 and cli.stdout == ""
    (line,) = cli.stderr.splitlines()
    assert line.startswith("foretell: error: FORETELL_BLAS: ")
    assert str(named) in line and "unset FORETELL_BLAS" in line
    if what == "missing":
        assert f"{named}: no such file" in line
    else:
        assert f"could not load {named}" in line


@linux_only
def test_vendored_gfortran_is_loadable_under_its_standard_soname():
    result = run_python(
        """
        import ctypes, json
        from foretell.platform import blas
        ok = blas._load_vendored_gfortran()
        lib = ctypes.CDLL("libgfortran.so.5")  # resolved by soname among loaded objects
        maps = open("/proc/self/maps").read()
        print(json.dumps({"ok": ok, "memfd": "memfd:libgfortran.so.5" in maps,
                          "symbol": hasattr(lib, "_gfortran_concat_string")}))
        """,
        FORETELL_BLAS="reference",
    )
    assert result == {"ok": True, "memfd": True, "symbol": True}


def test_a_build_for_missing_cpu_features_is_refused(monkeypatch):
    # Loading an AVX-512 build on an AVX2 CPU would kill the process at its first matmul.
    monkeypatch.setattr(blas, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma"}))
    reason = blas._unsupported("SKYLAKEX", explicit=False)
    assert reason is not None and "avx512f" in reason
    assert blas._unsupported("ZEN", explicit=False) is None
    assert blas._unsupported("HASWELL", explicit=True) is None


def test_an_unknown_build_is_refused_unless_the_user_named_it(monkeypatch):
    monkeypatch.setattr(blas, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert "unknown OpenBLAS core" in blas._unsupported("NEWCORE", explicit=False)
    assert blas._unsupported("NEWCORE", explicit=True) is None
    assert blas._unsupported(None, explicit=True) is None


def test_not_linux_is_a_no_op(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    status = blas._preload("")
    assert status.loaded is None
    assert status.reason.startswith("not Linux")


@linux_only
def test_reaching_the_engine_module_directly_still_binds_openblas_or_warns():
    # `from foretell.engine import load` imports mlx before foretell.load() could preload;
    # load() then says so rather than running several times slower in silence.
    caught = run_python(WARNINGS_FROM_TWO_LOADS.format(first="from foretell.engine import load"))
    assert [c[0] for c in caught] == ["SlowBlasWarning"]
