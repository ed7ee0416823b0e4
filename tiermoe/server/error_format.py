"""Error responses in the format of the API that was called: OpenAI's error object on /v1/* (and the server's
own endpoints), Ollama's {"error": "..."} on /api/*, Anthropic's {"type": "error", "error": {...}} on
/v1/messages (its error type named by the status, as Anthropic's server names it)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

OLLAMA_PREFIX = "/api/"
ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types by HTTP status (its API's "Errors" page); 503 is our busy server, Anthropic's 529.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 421: "permission_error",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error",
                         529: "overloaded_error"}


def openai_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def anthropic_error_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def api_error(path: str, status: int, message: str, kind: str = "invalid_request_error",
              param: str | None = None, headers: dict | None = None) -> JSONResponse:
    if path.startswith(OLLAMA_PREFIX):
        return JSONResponse(status_code=status, headers=headers, content={"error": message})
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(status_code=status, headers=headers, content=anthropic_error_body(status, message))
    return openai_error(status, message, kind, param, headers)
