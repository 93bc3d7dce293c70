"""``[cache]`` options of the ``redis`` layout: imported when plugins register, so attrs only
(the layout itself, numpy and the client load when a cache opens at a redis:// URL)."""

from __future__ import annotations

from typing import Any

import attrs

from foretell.config import number, whole_number

_positive, _non_negative = whole_number(1), number(0)


def _share(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        from foretell.config import FieldError

        raise FieldError(attribute.name, f"must be a number in (0, 1], got {value!r}")


def _key_prefix(_inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        from foretell.config import FieldError

        raise FieldError(attribute.name, f"must be a non-empty string without spaces, "
                                         f"got {value!r}")


@attrs.frozen(kw_only=True)
class RedisConfig:
    """``[cache]`` options of the ``redis`` layout."""

    block_tokens: int = attrs.field(
        default=256, validator=_positive,
        metadata={"help": "tokens (rows) per block, and per step of the leading-blocks "
                          "lookup; entries sharing a prefix share whole blocks of this many "
                          "tokens"})
    key_prefix: str = attrs.field(
        default="foretell", validator=_key_prefix,
        metadata={"help": "what every key this layout writes starts with"})
    memory_share: float = attrs.field(
        default=0.9, validator=_share,
        metadata={"help": "share of the server's maxmemory the entries may take: the "
                          "cache's byte cap is the smaller of this and max_gb, so foretell "
                          "evicts before the server has to"})
    timeout_s: float = attrs.field(
        default=10.0, validator=_non_negative,
        metadata={"help": "seconds one request may take before the server counts as "
                          "unreachable"})
    retry_s: float = attrs.field(
        default=1.0, validator=_non_negative,
        metadata={"help": "seconds after a failure before the server is tried again "
                          "(doubling per failure, at most 30); meanwhile the cache serves "
                          "from RAM and computes"})
    collect_grace_s: float = attrs.field(
        default=60.0, validator=_non_negative,
        metadata={"help": "unlisted blocks a writer stored less than this many seconds ago "
                          "are kept by collect(): another process may be about to publish "
                          "the entry that lists them"})
