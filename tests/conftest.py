import os
import shutil
import subprocess
from pathlib import Path

import pytest

from foretell.platform import blas

# This suite runs the engine on the CPU throughout; bind the optimized BLAS before any test
# module imports mlx, as `foretell.load()` would (importing foretell alone no longer does).
blas.preload()

_PLUGIN_ENV = ("FORETELL_LOAD_PLUGINS", "FORETELL_DISABLE_PLUGINS", "FORETELL_STRICT_PLUGINS")


@pytest.fixture(autouse=True)
def _no_plugin_env_leaks(monkeypatch):
    # The developer's (or CI's) plugin switches must not change what a test sees.
    for name in _PLUGIN_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _own_policy_memory(monkeypatch, tmp_path_factory):
    # `foretell run` keeps what its draft-length policy learned (foretell.spec.memory): a
    # state left by another test or session would change how a test's run drafts.
    monkeypatch.setenv("FORETELL_POLICY_MEMORY_DIR", str(tmp_path_factory.mktemp("policy")))


NGRAM_SOURCE = Path(__file__).resolve().parents[1] / "contrib" / "foretell-ngram"


@pytest.fixture(scope="session")
def _ngram_site(tmp_path_factory):
    """contrib/foretell-ngram installed by pip into a directory of its own, once a session:
    a real installed distribution (entry points and all) that leaves the environment the
    tests run in as it was (docs/decisions.md, "The README's test command")."""
    from foretell.plugin.testing import install_distribution

    return install_distribution(NGRAM_SOURCE, tmp_path_factory.mktemp("ngram-site"))


@pytest.fixture
def ngram_installed(_ngram_site, monkeypatch):
    """contrib's n-gram drafter is an installed plugin for this test, in this process and in
    the processes it starts. A copy the environment already has is the same distribution,
    so the loader takes whichever comes first on the path, once."""
    monkeypatch.syspath_prepend(str(_ngram_site))
    paths = [str(_ngram_site), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    return _ngram_site


@pytest.fixture
def killed_and_resumed(tmp_path):
    """``run(argv, env) -> (uninterrupted, resumed)``: ``argv`` (a ``foretell run`` command)
    runs to the end; then with ``--cache-dir DIR --resume`` it is killed with SIGKILL as
    soon as a generation checkpoint (an entry in a ``generation:`` namespace, of any layout)
    is on disk, and run again with ``--resume`` (``resume_extra`` appended). Both results are
    ``subprocess.CompletedProcess``es, already checked to have exited 0."""
    import signal
    import time

    def run(argv, env, resume_extra=()):
        # The spill writer at full duty: on a small host it rests 9x what it wrote
        # (cache.spill.SMALL_HOST_DUTY), so checkpoints land in bursts, each on disk for a
        # few milliseconds before the next replaces it, and the poll below can miss them all.
        env = {**env, "FORETELL_SPILL_DUTY": "1"}
        uninterrupted = subprocess.run(argv, capture_output=True, env=env, timeout=300)
        assert uninterrupted.returncode == 0, uninterrupted.stderr.decode()
        cache = tmp_path / "cache"
        resumable = [*argv, "--cache-dir", str(cache), "--resume"]
        for _attempt in range(3):  # a loaded host may finish a run before a poll sees one
            shutil.rmtree(cache, ignore_errors=True)
            victim = subprocess.Popen(resumable, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, env=env)
            deadline = time.monotonic() + 120
            try:
                while time.monotonic() < deadline and victim.poll() is None:
                    if _checkpoint_on_disk(cache):
                        victim.send_signal(signal.SIGKILL)
                        break
                    time.sleep(0.005)
            finally:
                victim.wait()
            if victim.returncode == -signal.SIGKILL:
                break
        assert victim.returncode == -signal.SIGKILL, "every run finished before it was killed"
        resumed = subprocess.run([*resumable, *resume_extra], capture_output=True, env=env,
                                 timeout=300)
        assert resumed.returncode == 0, resumed.stderr.decode()
        return uninterrupted, resumed

    return run


def _checkpoint_on_disk(cache) -> bool:
    """Whether some entry file (either layout's: a safetensors file whose header names its
    namespace) under ``cache`` is a generation checkpoint. Counting files was not enough: a
    run whose checkpoints landed late could show the prompt snapshot and its finished
    generation's entry (checkpoints deleted) and be killed with no checkpoint at all."""
    import json
    import struct

    from foretell.cache.tier import CHECKPOINT_PREFIX

    for path in cache.glob("**/*.safetensors"):
        try:
            with open(path, "rb") as fh:
                size = struct.unpack("<Q", fh.read(8))[0]
                meta = json.loads(fh.read(size)).get("__metadata__", {})
            header = json.loads(meta.get("foretell.header", "{}"))
        except (OSError, ValueError, struct.error):
            continue  # replaced or being written meanwhile
        if str(header.get("namespace", "")).startswith(CHECKPOINT_PREFIX):
            return True
    return False



class WorkerDied(Exception):
    """What :func:`dies_after` raises inside the scheduler's worker."""


@pytest.fixture
def dies_after():
    """``dies_after(n, start) -> tokens``: ``start()`` (a generation: ``engine.generate``'s
    events) read while the scheduler's worker "dies" after the step that took a request to
    ``n`` generated tokens (and took its checkpoint, if one was due): the step raises, so the running requests fail with no completion and no cleanup,
    as when the process is killed (what the cache tier was handed by then, checkpoints
    included, stays). Returns the tokens streamed before. Leaving a ``generate`` loop after
    ``n`` tokens would interrupt nothing: requests run on a worker thread that does not wait
    for its reader, and may well have finished by then."""
    from foretell.batch_step import BatchStep
    from foretell.errors import GenerationError

    def run(n, start):
        real = BatchStep._checkpoint

        def checkpoint(self, finished):  # after a step's commits, before its rows finish
            real(self, finished)
            if any(len(row.state.generated) >= n for row in self._rows):
                raise WorkerDied(f"the process died after {n} tokens")

        BatchStep._checkpoint = checkpoint
        seen = []
        try:
            with pytest.raises(GenerationError, match="the process died"):
                for event in start():
                    seen += event.tokens
        finally:
            BatchStep._checkpoint = real
        return seen

    return run


@pytest.fixture
def held_mid_request(monkeypatch):
    """``held_mid_request() -> (paused, go, rows)``: from then on the scheduler's worker
    stops after the step that takes its first row to 8 generated tokens (``paused`` is set)
    and waits for ``go``, so a test can submit a second request while the first is
    mid-request; ``rows`` records each step's row count (2 in it: the two ran together)."""
    import threading

    from foretell.batch_step import BatchStep

    paused, go, rows = threading.Event(), threading.Event(), []
    real = BatchStep._checkpoint

    def checkpoint(self, finished):  # after a step's commits, before its rows finish
        real(self, finished)
        rows.append(len(self._rows))
        if not paused.is_set() and len(self._rows[0].state.generated) >= 8:
            paused.set()
            go.wait(60)

    def hold():
        monkeypatch.setattr(BatchStep, "_checkpoint", checkpoint)
        return paused, go, rows

    yield hold
    go.set()  # a failed test never leaves the worker waiting
