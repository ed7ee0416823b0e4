"""Reading a JSON request body whatever its Content-Type says (curl -d and some Ollama clients send none)."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from tiermoe.errors import TiermoeError


async def read_body(request: Request, model: type[BaseModel]):
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TiermoeError("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise TiermoeError("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None
