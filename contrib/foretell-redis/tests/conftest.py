"""Fixtures for foretell-redis's tests: a real ``redis-server`` (or ``valkey-server``) started
on a free localhost port, and the plugin installed for real for tests that start processes.

Tests that need a server skip, with the reason, only where none can be started (no
``redis-server`` on the PATH, or it fails to start); the test modules skip when the ``redis``
client is not installed (``pip install ./contrib/foretell-redis`` brings it).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from foretell.platform import blas

blas.preload()  # before any test module imports mlx, as `foretell.load()` would

SOURCE = Path(__file__).resolve().parents[1]


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, without persistence, that a test may stop
    and start again on the same port (a restarted server comes back empty)."""

    def __init__(self, binary: str, directory: Path, port: int):
        self.binary, self.directory, self.port = binary, directory, port
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        log = self.directory / "server.log"
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory), "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(200):  # up to 10 s: a loaded 2-core host starts it slowly
            if self.process.poll() is not None:
                why = self.process.stderr.read().decode(errors="replace") or (
                    log.read_text(errors="replace") if log.exists() else "")
                pytest.skip(f"{self.binary} cannot start: {why.strip()[-300:]}")
            if self.answers():
                return
            time.sleep(0.05)
        self.stop()
        pytest.skip(f"{self.binary} did not answer on port {self.port} within 10 s")

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def client(self):
        import redis

        return redis.Redis(port=self.port)


def _server_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no redis-server or valkey-server on the PATH (Debian: apt-get install "
                "redis-server; .ci/run installs it)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(directory: Path) -> RedisServer:
    server = RedisServer(_server_binary(), directory, _free_port())
    server.start()
    return server


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory):
    """One server for a module's tests (each test gets it empty: :func:`redis_url`)."""
    server = start_server(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def redis_url(shared_server) -> str:
    shared_server.client().flushall()
    return shared_server.url


@pytest.fixture
def own_server(tmp_path):
    """A server of this test's own, which the test may stop and start again."""
    server = start_server(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _redis_site(tmp_path_factory):
    """contrib/foretell-redis installed by pip into a directory of its own, once a session:
    its entry point makes ``redis://`` locations select the layout, in this process and in
    the processes a test starts (the environment the tests run in stays as it was)."""
    from foretell.plugin.testing import install_distribution

    return install_distribution(SOURCE, tmp_path_factory.mktemp("redis-site"))


@pytest.fixture
def redis_installed(_redis_site, monkeypatch):
    """The plugin is installed for this test, here and in the processes it starts."""
    import importlib

    monkeypatch.syspath_prepend(str(_redis_site))
    paths = [str(_redis_site), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    importlib.invalidate_caches()
    return _redis_site
