"""The connection to the server, and which failures are the server's (the cache survives
them) rather than defects."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from foretell.errors import ConfigError
from foretell.store.layout import url_scheme
from foretell_redis import SCHEMES

if TYPE_CHECKING:
    from foretell_redis.layout import RedisConfig


#: Bytes the client asks of its socket at once (its default: 64 KiB). A restore is tens of
#: MB of block values: with hiredis, 4 MiB reads fetched them 1.5x as fast
#: (docs/decisions.md, "A shared tier on Redis").
SOCKET_READ_BYTES = 4 << 20


def connect(url: str, config: RedisConfig) -> Any:
    """A client of the server ``url`` names (``valkey://`` read as ``redis://``): requests
    bounded by ``timeout_s``, one retry (a connection the server closed by restarting), the
    layout's own back-off after that.

    :raises ConfigError: not a URL the client can use, or the client is not installed."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise ConfigError("cache_dir", [f"{without_credentials(url)}: the redis layout needs "
                                        "the redis client: pip install redis"]) from None
    scheme = url_scheme(url)
    if scheme not in SCHEMES:
        raise ConfigError("cache_dir", [f"{without_credentials(url)}: the redis layout "
                                        f"stores at {', '.join(s + '://' for s in SCHEMES)} "
                                        "URLs"])
    tls = scheme in ("rediss", "valkeys")
    client_url = ("rediss" if tls else "redis") + url.strip()[len(scheme):]
    try:
        return redis.Redis.from_url(client_url, socket_timeout=config.timeout_s or None,
                                    socket_connect_timeout=config.timeout_s or None,
                                    socket_read_size=SOCKET_READ_BYTES,
                                    retry=Retry(NoBackoff(), 1))
    except ValueError as exc:
        raise ConfigError("cache_dir", [f"{without_credentials(url)}: {exc}"]) from None


def without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` left out (messages and listings show it)."""
    scheme, sep, rest = url.strip().partition("://")
    host, at, tail = rest.partition("@")
    return f"{scheme}{sep}{tail}" if at and "/" not in host else url.strip()



def server_failure(exc: BaseException) -> bool:
    """A failure of the server or the way to it (unreachable, timed out, full, read-only,
    a key of another type): the cache's to survive. Anything else is a defect."""
    try:
        import redis
    except ImportError:
        return False
    return isinstance(exc, (redis.RedisError, OSError))


def server_full(exc: BaseException) -> bool:
    """Out of memory (``maxmemory`` with ``noeviction``): reads still work, so no back-off."""
    return "OOM" in str(exc) or "maxmemory" in str(exc)
