"""Running the server: listen, serve until SIGTERM or Ctrl-C, then drain and flush.

On SIGTERM (or SIGINT) uvicorn stops accepting connections and waits for the requests in
flight to finish; then the scheduler closes (anything still queued runs to its end), the
cache tier flushes its queued writes (bounded wait) and the log says whether the cache is
durable. uvicorn re-raises the signal that stopped it once it is done; a handler installed
here takes it, so the process exits 0 after the flush rather than dying of the signal.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any

from foretell.errors import ForetellError

if TYPE_CHECKING:
    from foretell.engine import Engine
    from foretell.serve.generation import Backend

log = logging.getLogger("foretell.serve")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (port 0: a free one), for uvicorn to accept on."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ForetellError(f"cannot resolve host {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ForetellError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def serve(backend: Backend, sock: socket.socket, *, api_key: str | None = None,
          access_log: bool = True) -> int:
    """Serve ``backend`` on ``sock`` until a signal stops it; then drain and flush (module
    docstring). Returns the exit status."""
    import uvicorn

    from foretell.serve.app import create_app

    app = create_app(backend, api_key=api_key)
    config = uvicorn.Config(app, lifespan="off", access_log=access_log, log_level="info",
                            timeout_graceful_shutdown=None)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"foretell serve: {backend.model_id} on http://{shown}:{port} (OpenAI /v1/chat/"
          "completions and /v1/completions, Anthropic /v1/messages; SIGTERM or Ctrl-C stops "
          "it)", file=sys.stderr, flush=True)
    stopped_by: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, _frame: stopped_by.append(number))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        close(backend.engine, backend.scheduler)
    return 0


def close(engine: Engine, scheduler: Any) -> None:
    """Finish what was submitted, then flush the cache tier and say whether it is durable."""
    from foretell.cache.spill import CLOSE_TIMEOUT_S

    waiting = scheduler.queue_depth + scheduler.running
    if waiting:
        print(f"foretell serve: finishing {waiting} requests", file=sys.stderr, flush=True)
    scheduler.close(drain=True)
    tier = engine.cache
    if tier is None:
        return
    report = tier.close(CLOSE_TIMEOUT_S)
    if tier.ssd is None:
        return
    if report.durable:
        print("foretell serve: the cache is durable (every stored prefix is on disk)",
              file=sys.stderr, flush=True)
    else:
        print(f"foretell serve: warning: the cache is not durable ({report.shortfall()})",
              file=sys.stderr, flush=True)
