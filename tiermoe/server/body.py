"""Reading a JSON request body whatever its Content-Type says (curl -d and some Ollama clients send none), at
most --max-request-bytes of it (a 413 beyond, found while reading: a huge body is never held whole).

The body is untrusted: JSON that Python's parser takes but the server cannot use is refused here with a 400
(TiermoeError), never left to fail later as a 500: nesting deeper than MAX_DEPTH (Python's parser would recurse
until RecursionError), integers longer than Python converts (ValueError), and strings holding a lone UTF-16
surrogate ("\\ud800": not text, so the tokenizer and the JSON encoder of an error message would both fail).
"""

from __future__ import annotations

import json
import sys

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tiermoe.errors import TiermoeError

MAX_DEPTH = 32  # the deepest body of the API nests 5 levels (messages, a message, its content parts, a part)


def parse_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw or b"{}")
    except RecursionError:
        raise TiermoeError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise TiermoeError("the request body is not valid JSON") from None
    except ValueError:  # an integer longer than Python converts (sys.get_int_max_str_digits)
        raise TiermoeError(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                           "digits") from None
    if not isinstance(data, dict):
        raise TiermoeError("the request body must be a JSON object")
    _check_values(data)
    return data


def _check_values(data: dict) -> None:
    """Depth and text of every value, walked with a stack (not recursion: the walk must not be the thing that
    overflows)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TiermoeError(f"the request body nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_text(value)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise TiermoeError("the request body holds a lone UTF-16 surrogate (e.g. \\ud800) in a string; "
                           "expected text (a surrogate only as half of a pair)") from None


def validate(data: dict, model: type[BaseModel]):
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from None


async def read_bytes(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk and refused (413) as soon as it is longer than `limit`: a huge body is never
    held whole, and a Content-Length beyond the limit is refused before any of it is read."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def too_large_message(limit: int) -> str:
    """What a 413 says (here, and where the admission middleware reads a generation request's body)."""
    return f"the request body is longer than this server takes ({limit} bytes; --max-request-bytes)"


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, too_large_message(limit))


def openapi_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` that declares `model` as a route's JSON body: the routes read the body themselves (bounded,
    off the event loop), so FastAPI would not know it. The schema is self-contained (definitions inlined), so a
    client or a fuzzer can use it as it stands."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline({**definitions[ref.removeprefix("#/$defs/")], **{k: v for k, v in node.items()
                                                                                  if k != "$ref"}})
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


async def read_body(request: Request, model: type[BaseModel], limit: int):
    """The body as `model`; the JSON parsed and checked on a worker thread (an 8 MiB body takes a while)."""
    raw = await read_bytes(request, limit)
    return await run_in_threadpool(lambda: validate(parse_json(raw), model))
