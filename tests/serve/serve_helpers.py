"""The serve tests' live server: ``foretell serve`` started as a user starts it, in a
process of its own on a free localhost port, stopped with SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class Server:
    """A ``foretell serve`` process: its URL, its log, and how to stop it."""

    def __init__(self, *args: str, cwd: Path, env: dict[str, str] | None = None) -> None:
        env = {**{k: v for k, v in os.environ.items() if k != "FORETELL_API_KEY"},
               **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "foretell", "serve", "--port", "0", "--draft", "none",
             "--no-access-log", *args],
            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.port = None
        for line in self.proc.stdout:
            self.lines.append(line)
            found = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break
        if self.port is None:
            raise AssertionError("the server did not start:\n" + "".join(self.lines))
        self._drain = threading.Thread(target=self._read, daemon=True)
        self._drain.start()
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(600):  # the socket is bound; uvicorn listens once it has started
            try:
                if self.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("the server never answered /health")

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        """One plain HTTP request: ``(status, headers, body)``."""
        if isinstance(body, dict):
            body = json.dumps(body)
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{"name{labels}": value}``."""
        text = self.request("GET", "/metrics")[2].decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line and not line.startswith("#")}

    def stop(self) -> int:
        """SIGTERM, then the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=300)
        finally:
            self._drain.join(timeout=10)
