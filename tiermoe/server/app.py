"""The FastAPI app around one loaded model: routes, the checks every request passes (outermost first: which web
page sent it, tiermoe.server.origin_check; the API key; room for it, tiermoe.server.admission), errors in each
API's format, engine lifetime."""

from __future__ import annotations

import hmac
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tiermoe.errors import TiermoeError
from tiermoe.server import (
    adapter_routes,
    admin_routes,
    anthropic_routes,
    completion_routes,
    ollama_routes,
    openai_routes,
    root_route,
    sglang_routes,
)
from tiermoe.server.admission import (
    AdmissionMiddleware,
    AdmissionRefused,
    busy_response,
)
from tiermoe.server.error_format import api_error
from tiermoe.server.generation import GenerationFailed
from tiermoe.server.origin_check import OriginCheck
from tiermoe.server.state import ServerState

OPEN_PATHS = ("/health",)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.service.start()
        yield
        state.service.stop()  # drain: running requests finish first

    app = FastAPI(title="tiermoe", lifespan=lifespan)
    app.state.tiermoe = state
    for module in (openai_routes, completion_routes, anthropic_routes, sglang_routes, adapter_routes, ollama_routes,
                   admin_routes, root_route):
        app.include_router(module.router)

    # Each middleware added wraps the ones before it: admission is the innermost (a request refused for its
    # origin or its key never takes a slot), the origin check the outermost (it answers CORS preflights, which
    # carry no key, and puts CORS headers on every answer to an allowed page, a 401 included).
    app.add_middleware(AdmissionMiddleware, admission=state.admission, metrics=state.metrics,
                       max_body_bytes=state.config.max_request_bytes, body_timeout=state.config.body_timeout)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        key = state.config.api_key
        if key and request.url.path not in OPEN_PATHS:
            # Anthropic's clients send the key as x-api-key, everyone else's as a bearer token: the same key
            given = request.headers.get("x-api-key") or request.headers.get("authorization", "").removeprefix(
                "Bearer ").strip()
            if not hmac.compare_digest(given.encode(), key.encode()):
                return api_error(request.url.path, 401, "missing or wrong API key (send 'Authorization: Bearer KEY' "
                                 "or 'x-api-key: KEY')", "authentication_error")
        return await call_next(request)

    app.add_middleware(OriginCheck, config=state.config, open_paths=OPEN_PATHS)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        else:
            said = first.get("msg", "invalid value").removeprefix("Value error, ")  # a validator's own message
            message = f"{where}: {said}" if where else said
        return api_error(request.url.path, 400, message, param=where or None)

    @app.exception_handler(TiermoeError)
    async def user_error(request: Request, err: TiermoeError):
        return api_error(request.url.path, 400, str(err))

    @app.exception_handler(AdmissionRefused)
    async def batch_refused(request: Request, err: AdmissionRefused):
        state.metrics.add(requests_refused=1)
        return busy_response(request.url.path, str(err))

    @app.exception_handler(GenerationFailed)
    async def generation_failed(request: Request, err: GenerationFailed):
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        return api_error(request.url.path, err.status, f"generation failed: {err}", kind)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return api_error(request.url.path, err.status_code, str(err.detail), kind)

    return app
