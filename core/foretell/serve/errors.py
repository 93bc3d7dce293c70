"""Errors a client sees: each an HTTP status and the API's own error JSON.

A handler raises :class:`APIError` for anything wrong with the request (4xx); the app
renders it in the shape of the API the route belongs to: OpenAI's
``{"error": {"message", "type", "param", "code"}}`` or Anthropic's
``{"type": "error", "error": {"type", "message"}}``. Anything else is the server's fault: a
500 that says so, logged with its traceback, never sent to the client.
"""

from __future__ import annotations

from typing import Any

#: Anthropic's error type for each status it documents.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
#: OpenAI's error type for each status.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A request the server refuses: ``status``, a message naming the field, and for
    OpenAI's shape the offending ``param`` and a machine-readable ``code``."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message,
                          "type": _OPENAI_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error",
                "error": {"type": _ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                          "message": self.message}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
