import pytest

from foretell import blas

# This suite runs the engine on the CPU throughout; bind the optimized BLAS before any test
# module imports mlx, as `foretell.load()` would (importing foretell alone no longer does).
blas.preload()

_PLUGIN_ENV = ("FORETELL_LOAD_PLUGINS", "FORETELL_DISABLE_PLUGINS", "FORETELL_STRICT_PLUGINS")


@pytest.fixture(autouse=True)
def _no_plugin_env_leaks(monkeypatch):
    # The developer's (or CI's) plugin switches must not change what a test sees.
    for name in _PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def killed_and_resumed(tmp_path):
    """``run(argv, env) -> (uninterrupted, resumed)``: ``argv`` (a ``foretell run`` command)
    runs to the end; then with ``--cache-dir DIR --resume`` it is killed with SIGKILL as
    soon as a generation checkpoint (an entry past the prompt snapshot, of any layout) is
    on disk, and run again with ``--resume`` (``resume_extra`` appended). Both results are
    ``subprocess.CompletedProcess``es, already checked to have exited 0."""
    import signal
    import subprocess
    import time

    def run(argv, env, resume_extra=()):
        uninterrupted = subprocess.run(argv, capture_output=True, env=env, timeout=300)
        assert uninterrupted.returncode == 0, uninterrupted.stderr.decode()
        cache = tmp_path / "cache"
        resumable = [*argv, "--cache-dir", str(cache), "--resume"]
        victim = subprocess.Popen(resumable, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline and victim.poll() is None:
                if len(list(cache.glob("**/*.safetensors"))) >= 2:
                    break
                time.sleep(0.02)
            assert victim.poll() is None, "the run finished before it could be killed"
            victim.send_signal(signal.SIGKILL)
        finally:
            victim.wait()
        resumed = subprocess.run([*resumable, *resume_extra], capture_output=True, env=env,
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stderr.decode()
        return uninterrupted, resumed

    return run
