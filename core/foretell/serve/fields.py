"""Reading a request body: every field checked for its type and range, unknown fields
refused, each problem a 400 that names the field (``messages[2].content``)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from foretell.serve.errors import APIError, bad_request

#: The most bytes a request body may have (a prompt of this size is far past any context).
MAX_BODY_BYTES = 32 << 20


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object."""
    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at line "
                          f"{exc.lineno} column {exc.colno}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, not {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def refuse_unknown(body: Mapping[str, Any], known: Iterable[str], where: str = "") -> None:
    """A 400 naming the first field not in ``known``."""
    known = set(known)
    for name in body:
        if name not in known:
            path = f"{where}.{name}" if where else name
            raise bad_request(f"unknown field '{path}' (this server reads: "
                              f"{', '.join(sorted(known))})", param=path)


def field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...], *,
          where: str = "", required: bool = False, default: Any = None) -> Any:
    """``body[name]`` if it is of ``kind`` (null counts as absent); a 400 otherwise."""
    path = f"{where}.{name}" if where else name
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"'{path}' is required", param=path)
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = " or ".join({str: "a string", int: "an integer", float: "a number",
                             bool: "a boolean", list: "an array", dict: "an object"}[k]
                            for k in kinds)
        raise bad_request(f"'{path}' must be {names}, got {_kind(value)}", param=path)
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"'{path}' must be a finite number", param=path)
    return value


def number(body: Mapping[str, Any], name: str, *, lo: float, hi: float, where: str = "",
           integer: bool = False, default: Any = None) -> Any:
    """A number in ``[lo, hi]`` (an integer when ``integer``)."""
    path = f"{where}.{name}" if where else name
    value = field(body, name, int if integer else float, where=where, default=default)
    if value is not None and body.get(name) is not None and not lo <= value <= hi:
        raise bad_request(f"'{path}' must be between {lo:g} and {hi:g}, got {value}",
                          param=path)
    return value


def neutral(body: Mapping[str, Any], name: str, neutral_values: tuple[Any, ...],
            why: str) -> None:
    """A field this server knows but does not implement: accepted only at a value that asks
    for nothing (``n`` of 1, a penalty of 0)."""
    value = body.get(name)
    if value is not None and value not in neutral_values:
        raise bad_request(f"'{name}' = {json.dumps(value)} is not supported: {why}", param=name)


def stop_strings(body: Mapping[str, Any], name: str) -> list[str]:
    """``stop`` / ``stop_sequences``: a string or an array of non-empty strings."""
    value = body.get(name)
    if value is None:
        return []
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise bad_request(f"'{name}' must be a string or an array of strings", param=name)
    if len(values) > 16:
        raise bad_request(f"'{name}' lists {len(values)} strings; at most 16", param=name)
    return [s for s in values if s]


def model_name(body: Mapping[str, Any], served: Iterable[str]) -> str:
    name = field(body, "model", str, required=True)
    served = list(served)
    if name not in served:
        raise APIError(404, f"model '{name}' is not served here; this server serves "
                            f"{', '.join(repr(s) for s in served)} (GET /v1/models)",
                       param="model", code="model_not_found")
    return name
