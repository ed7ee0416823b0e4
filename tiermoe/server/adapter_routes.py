"""SGLang's adapter endpoints: LoRA adapters loaded and unloaded while the server runs, served per request.

POST /load_lora_adapter {"lora_name", "lora_path"} reads a PEFT adapter directory on the server's machine (on a
worker thread: the event loop keeps serving), then puts it into the model between two engine steps; POST
/unload_lora_adapter {"lora_name"} takes it out. Both answer SGLang's `{"success": true, "error_message": "",
"loaded_adapters": {name: path}}`; what goes wrong is a 400 in the server's error format. Loading is on only when
the server was started with `--enable-lora` or an adapter (`--lora NAME=DIR`, `--lora-paths`): the endpoint reads
any directory the server may read.

Unloading an adapter that requests are running with waits for them, as SGLang's does: from the moment the unload
arrives no new request may ask for the name (a 400 naming it), the requests already running finish with it, and
then its slot is freed and the answer sent. A 409 instead would leave the client to retry until the adapter is
idle, which a busy adapter may never be; waiting never breaks a request, and a client that will not wait may stop
waiting: the unload goes on all the same (the engine frees the slot when its last request ends).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr
from starlette.concurrency import run_in_threadpool

from tiermoe.errors import TiermoeError
from tiermoe.model.served_adapters import check_adapter_name
from tiermoe.server.body import openapi_body, read_body
from tiermoe.server.state import ServerState

router = APIRouter()
FREED_POLL_S = 0.02  # how often an unload looks whether the engine has freed the adapter


class LoadLoRAAdapter(BaseModel):
    """SGLang's LoadLoRAAdapterReqInput (`pinned` is taken: every loaded adapter stays resident here)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr
    pinned: StrictBool = False


class UnloadLoRAAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr


def _state(request: Request) -> ServerState:
    return request.app.state.tiermoe


def _answer(state: ServerState) -> dict:
    served = state.llm.engine.adapters
    return {"success": True, "error_message": "", "loaded_adapters": served.paths() if served else {}}


@router.post("/load_lora_adapter", openapi_extra=openapi_body(LoadLoRAAdapter))
async def load_lora_adapter(request: Request):
    state = _state(request)
    body = await read_body(request, LoadLoRAAdapter, state.config.max_request_bytes)
    if state.adapter_reader is None:
        raise TiermoeError("loading adapters is off on this server; start it with --enable-lora (or with adapters: "
                           "--lora NAME=DIR)")
    name = check_adapter_name(body.lora_name)
    if name == state.model_name:
        raise TiermoeError(f"lora_name: {name!r} is the served model's name; an adapter needs a name of its own")
    if name in state.adapters:
        raise TiermoeError(f"lora_name: an adapter named {name!r} is loaded already; unload it first")
    lora = await run_in_threadpool(state.adapter_reader, body.lora_path)  # seconds: PEFT lays the adapter out
    served = state.llm.engine.adapters
    await state.service.between_steps(lambda: served.load(name, lora, body.lora_path))
    return _answer(state)


@router.post("/unload_lora_adapter", openapi_extra=openapi_body(UnloadLoRAAdapter))
async def unload_lora_adapter(request: Request):
    state = _state(request)
    body = await read_body(request, UnloadLoRAAdapter, state.config.max_request_bytes)
    served, engine = state.llm.engine.adapters, state.llm.engine
    if served is None:
        raise TiermoeError(f"lora_name: there is no LoRA adapter {body.lora_name[:80]!r} on this server (none is "
                           "loaded)")
    adapter = await state.service.between_steps(lambda: served.retire(body.lora_name))
    await state.service.between_steps(engine.free_unused_adapters)
    while not adapter.freed:  # its requests are running: the engine frees it after the last one's step
        await asyncio.sleep(FREED_POLL_S)
    return _answer(state)
