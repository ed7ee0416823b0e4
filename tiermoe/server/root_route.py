"""GET / (and HEAD /): what this server is and where its APIs are, so a browser or `curl` pointed at the address
learns what answers there (Ollama answers "Ollama is running"; its command line checks the server with HEAD /)."""

from __future__ import annotations

from fastapi import APIRouter, Request

import tiermoe
from tiermoe.server.state import ServerState

router = APIRouter()

# API -> its endpoints (method and path); tests/test_server_root_page.py checks each is a route of the app
ENDPOINTS = {
    "OpenAI": ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"],
    "Anthropic": ["POST /v1/messages", "POST /v1/messages/count_tokens"],
    "Ollama": ["POST /api/chat", "POST /api/generate", "GET /api/tags", "POST /api/show"],
    "SGLang": ["POST /generate", "POST /load_lora_adapter", "POST /unload_lora_adapter",
               "POST /start_expert_distribution_record", "POST /stop_expert_distribution_record",
               "POST /dump_expert_distribution_record"],
    "operations": ["GET /health", "GET /metrics", "GET /placement"],
    "documentation": ["GET /docs", "GET /openapi.json"],
}


@router.get("/")
@router.head("/", include_in_schema=False)  # the same answer, its body left out
async def root(request: Request):
    state: ServerState = request.app.state.tiermoe
    return {"message": f"tiermoe is running, serving {state.model_name}", "server": "tiermoe",
            "version": tiermoe.__version__, "model": state.model_name, "endpoints": ENDPOINTS}
