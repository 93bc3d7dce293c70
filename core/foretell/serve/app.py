"""The ASGI app: the routes, the API key, and what every request goes through.

Each route reads its body as JSON (at most :data:`~foretell.serve.fields.MAX_BODY_BYTES`),
checks the key where one is set, and runs its handler; an :class:`APIError` becomes the
route's API's error JSON, a :class:`~foretell.errors.ForetellError` a 400 with its message,
anything else a 500 that names no internals (its traceback goes to the server's log).
``/health`` and ``/metrics`` need no key (probes and scrapers), every ``/v1`` route does.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from foretell.errors import ForetellError
from foretell.serve import anthropic_routes, openai_routes
from foretell.serve.errors import APIError
from foretell.serve.fields import MAX_BODY_BYTES, parse_json
from foretell.serve.generation import Backend, ClientGone

log = logging.getLogger("foretell.serve")

Handler = Callable[[Backend, Any, Any], Awaitable[Response]]


def create_app(backend: Backend, *, api_key: str | None = None) -> Starlette:
    """The server's app over ``backend``; with ``api_key``, every ``/v1`` route needs it."""

    def route(path: str, api: str, handler: Handler, method: str = "POST") -> Route:
        async def run(request: Request) -> Response:
            status = 500
            try:
                _check_key(request, api_key)
                body = await _read_json(request) if method == "POST" else None
                response = await handler(backend, body, request.receive)
                status = response.status_code
                return response
            except APIError as exc:
                status = exc.status
                return _error(exc, api)
            except ForetellError as exc:
                status = 400
                return _error(APIError(400, str(exc)), api)
            except ClientGone:
                status = 499  # nginx's "client closed request": no one reads this response
                return Response(status_code=status)
            except Exception:
                log.exception("%s %s failed", request.method, path)
                return _error(APIError(500, "the server failed on this request (its log has "
                                            "the details)"), api)
            finally:
                backend.metrics.request(path, status)

        return Route(path, run, methods=[method])

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": backend.model_id,
                             "running": backend.scheduler.running,
                             "queue_depth": backend.scheduler.queue_depth})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(backend.metrics.render(backend.scheduler, backend.engine.cache),
                                 media_type="text/plain; version=0.0.4")

    async def models(backend: Backend, body: Any, receive: Any) -> Response:
        return openai_routes.models(backend)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        api = "anthropic" if request.url.path.startswith("/v1/messages") else "openai"
        message = (f"no route {request.method} {request.url.path}" if exc.status_code == 404
                   else f"{request.method} is not allowed on {request.url.path}")
        return _error(APIError(exc.status_code, message), api)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        route("/v1/models", "openai", models, method="GET"),
        route("/v1/chat/completions", "openai", openai_routes.chat_completions),
        route("/v1/completions", "openai", openai_routes.completions),
        route("/v1/messages", "anthropic", anthropic_routes.messages),
        route("/v1/messages/count_tokens", "anthropic", anthropic_routes.count_tokens),
    ]
    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})


def _error(exc: APIError, api: str) -> Response:
    body = exc.anthropic_body() if api == "anthropic" else exc.openai_body()
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def _check_key(request: Request, key: str | None) -> None:
    if key is None:
        return
    given = request.headers.get("x-api-key")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if given is None and scheme.lower() == "bearer":
        given = token.strip()
    if not given:
        raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' (OpenAI "
                            "clients) or 'x-api-key: KEY' (Anthropic clients)")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise APIError(401, "invalid API key", code="invalid_api_key")


async def _read_json(request: Request) -> dict[str, Any]:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _too_large()
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def _too_large() -> APIError:
    return APIError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
