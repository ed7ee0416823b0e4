"""Error responses in the format of the API that was called: OpenAI's error object on /v1/* (and the server's
own endpoints), Ollama's {"error": "..."} on /api/*."""

from __future__ import annotations

from fastapi.responses import JSONResponse

OLLAMA_PREFIX = "/api/"


def openai_error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def api_error(path: str, status: int, message: str, kind: str = "invalid_request_error",
              param: str | None = None, headers: dict | None = None) -> JSONResponse:
    if path.startswith(OLLAMA_PREFIX):
        return JSONResponse(status_code=status, headers=headers, content={"error": message})
    return openai_error(status, message, kind, param, headers)
