"""Operations endpoints: /health, /metrics (Prometheus), /placement, and SGLang's recorder controls."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from tiermoe.errors import TiermoeError
from tiermoe.server.error_format import api_error
from tiermoe.server.expert_metrics import render_expert_metrics
from tiermoe.server.state import ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.tiermoe


@router.get("/health")
async def health(request: Request):
    """200 while requests can be served; 503 once the engine stopped for good (a supervisor restarts us)."""
    service = _state(request).service
    if not service.healthy:
        error = service.fatal_error or "the engine thread is not running"
        return JSONResponse({"status": "error", "error": str(error)}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    state = _state(request)
    swaps = state.llm.hybrid.swap_stats
    gauges = {"queue_length": state.service.queue_length, "running_requests": state.service.running,
              "requests_in_flight": state.admission.in_flight,
              "gpu_tier_hit_rate": state.hits.hit_rate(), "expert_swaps_total": swaps.swaps,
              "expert_bytes_copied_total": swaps.bytes, **kv_pool_gauges(state.llm.engine)}
    text = state.metrics.render(gauges)
    if state.expert_load is not None:
        text += render_expert_metrics(state.expert_load)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def kv_pool_gauges(engine) -> dict[str, float]:
    """The KV pool as /metrics reports it (read between steps, as every other gauge: counts, not tensors)."""
    pool = engine.pool
    used, total = pool.used_pages().get(None, 0), pool.pages.num_pages.get(None, 0)
    return {"kv_pool_tokens": pool.tokens, "kv_pool_used_tokens": used * pool.page_size,
            "kv_pool_usage": used / total if total else 0.0, "kv_pool_reserved_bytes": pool.nbytes(),
            "kv_pool_bytes_per_token": pool.pages.bytes_per_token(),
            "kv_pool_cached_prefix_tokens": pool.cached_pages() * pool.page_size,
            "prefix_cache_hit_tokens_total": engine.prefix_hit_tokens, "preemptions_total": engine.preemptions}


@router.get("/placement")
async def placement(request: Request):
    state = _state(request)
    hybrid = state.llm.hybrid
    plan = hybrid.plan  # read once: dynamic placement may move experts between two reads
    swaps = hybrid.swap_stats
    return {"model_type": hybrid.spec.model_type, "num_layers": plan.num_layers,
            "num_experts": plan.num_experts, "moe_layers": list(hybrid.spec.moe_layers),
            "gpu_experts_per_layer": plan.gpu_experts_per_layer(), "num_gpu_experts": int(plan.mask.sum()),
            "num_gpus": plan.num_gpus, "assignment": plan.assignment.tolist(),
            "gpu_hit_rate": state.hits.hit_rate(), "per_layer_gpu_hit_rate": state.hits.layer_hit_rates(),
            "swaps": swaps.swaps, "bytes_copied": swaps.bytes}


def _recorder(state: ServerState):
    if state.recorder_control is None:
        raise TiermoeError("the expert distribution recorder is off; start the server with "
                           "--expert-distribution-recorder-mode stat|per_pass|per_token")
    return state.recorder_control


# The recorder is touched only between engine steps, on the engine thread, so a pass is never half recorded.
# POST only: SGLang takes GET too, but a GET is what any web page can send with an <img src> (no Origin header,
# and older browsers send no Sec-Fetch-Site either), while a page's POST carries its Origin (in every browser of
# the last years), which tiermoe.server.origin_check refuses. SGLang's own clients POST
# (docs/coming-from-ktransformers.md).
RECORDER_PATHS = ("/start_expert_distribution_record", "/stop_expert_distribution_record",
                  "/dump_expert_distribution_record")


async def recorder_by_get(request: Request):
    return api_error(request.url.path, 405, f"{request.url.path} takes POST only (a GET could come from any web "
                                            "page's <img> tag)", headers={"Allow": "POST"})


for _path in RECORDER_PATHS:
    router.add_api_route(_path, recorder_by_get, methods=["GET"], include_in_schema=False)


@router.post("/start_expert_distribution_record")
async def start_record(request: Request):
    state = _state(request)
    await state.service.between_steps(_recorder(state).start)
    return {"message": "expert distribution recording started"}


@router.post("/stop_expert_distribution_record")
async def stop_record(request: Request):
    state = _state(request)
    await state.service.between_steps(_recorder(state).stop)
    return {"message": "expert distribution recording stopped"}


@router.post("/dump_expert_distribution_record")
async def dump_record(request: Request):
    state = _state(request)
    paths = await state.service.between_steps(_recorder(state).dump)
    return {"message": "expert distribution dumped", "files": [str(p) for p in paths]}
