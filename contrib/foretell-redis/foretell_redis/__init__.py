"""foretell-redis: the ``redis`` storage layout, foretell's KV cache entries kept in Redis or
Valkey so that processes and machines sharing one server share every prefix any of them
computed. A cache location ``redis://HOST:PORT/DB`` (also ``rediss://``, ``valkey://``,
``valkeys://``) selects it: ``--cache-dir``, ``[cache] dir``, ``foretell.load(cache=...)``.
"""

import foretell

SCHEMES = ("redis", "rediss", "valkey", "valkeys")


@foretell.hookimpl
def foretell_register_storage_layouts(register):
    from foretell_redis.config import RedisConfig

    register(
        "redis",
        "foretell_redis.layout:RedisLayout",
        config=RedisConfig,
        schemes=SCHEMES,
        summary="the block store's content-addressed blocks in Redis/Valkey, shared by "
                "every process using the server",
    )
