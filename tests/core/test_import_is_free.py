"""``import foretell`` and foretell's pytest plugin are cheap and change nothing in the process.

pytest imports the plugin in every session of every environment with foretell installed; it
used to import the plugin machinery and preload OpenBLAS globally into unrelated test runs.
Each case runs in a fresh interpreter, since this process imported everything long ago.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

REPORT = """
import json, sys
from pathlib import Path
maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
print(json.dumps({{
    "modules": sorted(sys.modules),
    "openblas_mapped": "openblas" in maps.lower(),
    "blas": __import__("foretell.platform.blas").platform.blas.STATUS.reason if {report_blas} else None,
}}))
"""


def python(code: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def third_party(modules: list[str], baseline: set[str]) -> set[str]:
    """Top-level modules that are neither foretell's, pluggy's nor already in a bare start."""
    tops = {m.split(".")[0] for m in modules} - {m.split(".")[0] for m in baseline}
    return tops - {"foretell", "pluggy"} - set(sys.stdlib_module_names)


@pytest.fixture(scope="module")
def bare() -> set[str]:
    """What a pytest session has loaded before any foretell import."""
    return set(python("import pytest\n" + REPORT.format(report_blas=False))["modules"])


@pytest.mark.parametrize("module", ["foretell", "foretell.plugin.pytest_plugin"])
def test_importing_foretell_loads_no_blas_mlx_or_plugin_machinery(module, bare):
    code = f"import pytest\nimport {module}\n" + REPORT.format(report_blas=False)
    after = python(code)
    assert not after["openblas_mapped"]
    imported = third_party(after["modules"], bare)
    assert imported == set(), f"import {module} pulled in {sorted(imported)}"
    assert not {"foretell.plugin.loader", "foretell.platform.blas", "mlx", "mlx.core"} & set(after["modules"])


def test_a_pytest_session_in_an_env_with_foretell_keeps_its_process_untouched(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(
        textwrap.dedent(
            """
            import sys
            from pathlib import Path

            def test_nothing_of_foretell_is_loaded(request):
                assert request.config.pluginmanager.has_plugin("foretell")
                assert "openblas" not in Path("/proc/self/maps").read_text().lower()
                assert "mlx.core" not in sys.modules and "foretell.plugin.loader" not in sys.modules

            def test_fixtures_still_work(foretell_plugins):
                assert [r.name for r in foretell_plugins.records] == ["baseline"]
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the preload is Linux-only")
def test_the_engine_entry_point_is_where_openblas_is_bound():
    code = "import foretell\nforetell.load\n" + REPORT.format(report_blas=True)
    after = python(code)
    assert after["openblas_mapped"] and after["blas"] == "loaded"
