"""One process serving HTTP: the server state built from the flags (or around rank 0's LLM), and the uvicorn loop
that drains on Ctrl-C / SIGTERM; a second Ctrl-C stops at once and exits with status 130."""

from __future__ import annotations

import logging
import signal

import uvicorn

from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.lora_args import MERGED_NOTE, adapter_reader, lora_choice, lora_from_args, served_loras
from tiermoe.cli.placement_args import check_fit_from_args, plan_from_args
from tiermoe.cli.placement_flags import dynamic_from_args
from tiermoe.cli.recorder_args import recorder_from_args
from tiermoe.cli.serve_flags import server_config_from_args
from tiermoe.cli.speculative_args import speculative_from_args
from tiermoe.config import check_device
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.server.app import create_app
from tiermoe.server.decode_log import DecodeLog
from tiermoe.server.engine_service import EngineService
from tiermoe.server.expert_metrics import ExpertLoadCounter
from tiermoe.server.gc_freeze import freeze_startup_heap
from tiermoe.server.idle_connections import idle_closing_h11
from tiermoe.server.metrics import ServerMetrics
from tiermoe.server.state import ServerState
from tiermoe.stats.control import RecorderControl
from tiermoe.stats.tier_hits import TierHitCounter

log = logging.getLogger(__name__)


def build_state(args, llm=None):
    config = server_config_from_args(args)
    choice = lora_choice(args)
    served = {}
    if llm is None:
        device = check_device(args.gpu_device)
        lora = lora_from_args(args)
        if lora is not None:
            log.info(MERGED_NOTE)
        served = served_loras(choice, args.model)  # read and checked before any weight loads
        plan = plan_from_args(args, device)
        check_fit_from_args(args, plan, device)
        llm = LLM(args.model, gpu_device=device, placement=plan,
                  dynamic=dynamic_from_args(args), max_running=config.max_running_requests,
                  prefill_chunk=config.chunked_prefill_size, max_total_tokens=config.max_total_tokens,
                  cpu=cpu_from_args(args), page_size=args.page_size, prefix_cache=not args.no_prefix_cache,
                  lora=lora, attention_backend=args.attention_backend, speculative=speculative_from_args(args))
    name = config.served_model_name or llm.model_dir.name
    if choice.per_request:
        adapters = llm.engine.serve_adapters(args.max_loras_per_batch)
        for adapter, (lora, path) in served.items():
            if adapter == name:
                raise TiermoeError(f"--lora {adapter}=...: {adapter!r} is the served model's name; an adapter needs "
                                   "a name of its own")
            adapters.load(adapter, lora, path)
        log.info("serving %d LoRA adapter(s) per request: %s", len(served), ", ".join(served) or "none yet")
    hits = TierHitCounter(llm.hybrid.spec.num_layers, llm.hybrid.gpu_device)
    llm.engine.add_recorder(hits)
    control = None
    if getattr(args, "recorder_mode", None):
        recorder = recorder_from_args(args, llm.hybrid.spec)
        llm.engine.add_recorder(recorder)
        control = RecorderControl(recorder)  # starts stopped, as in SGLang: /start_expert_distribution_record
    expert_load = None
    if config.expert_distribution_metrics:
        spec = llm.hybrid.spec
        expert_load = ExpertLoadCounter(spec.num_layers, spec.num_experts, llm.hybrid.gpu_device)
        llm.engine.add_recorder(expert_load)
    metrics = ServerMetrics()
    service = EngineService(llm.engine, metrics, watchdog_timeout=config.watchdog_timeout,
                            decode_log=DecodeLog(args.decode_log_interval))
    return ServerState(llm=llm, config=config, service=service, metrics=metrics, hits=hits, model_name=name,
                       recorder_control=control, expert_load=expert_load,
                       adapter_reader=adapter_reader(llm.model_dir) if choice.per_request else None)


FORCED_STOP = "a second Ctrl-C stopped the server at once; the requests still running were cut off"


class _QuietAfterForcedStop(logging.Filter):
    """Once a second Ctrl-C has stopped the server at once, the requests and the application lifespan it cut off
    end cancelled, and uvicorn logs each as an error with its traceback: they are the stop asked for, not errors."""

    def __init__(self, server):
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.server.force_exit and record.levelno >= logging.ERROR)


def show_tiermoe_logs() -> logging.Handler | None:
    """Print the `tiermoe` logger's INFO lines (dynamic expert updates, ...) on stderr the way uvicorn prints its
    own, unless logging is already set up (a handler on the root or the tiermoe logger): Python's default shows
    WARNING and above only. Returns the handler added, if any."""
    logger = logging.getLogger("tiermoe")
    if logger.handlers or logging.getLogger().handlers:
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    return handler


def serve(state) -> None:
    """Serve HTTP until Ctrl-C / SIGTERM (then drain), or until the engine fails for good (then raise that).
    A second Ctrl-C while draining stops at once: KeyboardInterrupt (status 130, one line), no traceback."""


    class DrainingServer(uvicorn.Server):
        """Ctrl-C / SIGTERM: stop accepting, let running requests finish, exit with status 0. (uvicorn re-raises
        the signal after its graceful shutdown, which would end the process as killed by it.)"""

        def handle_exit(self, sig, frame) -> None:
            # a second Ctrl-C stops at once, and stays a forced stop whatever signal comes next
            self.force_exit = self.force_exit or (self.should_exit and sig == signal.SIGINT)
            self.should_exit = True

    print(f"serving {state.model_name} on http://{state.config.host}:{state.config.port} "
          f"(OpenAI: /v1, Ollama: /api, metrics: /metrics)", flush=True)
    config = uvicorn.Config(create_app(state), host=state.config.host, port=state.config.port, log_level="info",
                            timeout_graceful_shutdown=60, timeout_keep_alive=state.config.keep_alive_timeout,
                            http=idle_closing_h11(state.config.body_timeout))
    server = DrainingServer(config)

    def stop_serving(err) -> None:  # called from the engine thread: uvicorn polls should_exit
        server.should_exit = True

    state.service.on_fatal = stop_serving
    quiet = _QuietAfterForcedStop(server)
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(quiet)
    freeze_startup_heap()  # the model, its tokenizer and the app are built: collections while serving skip them
    try:
        server.run()
    finally:
        uvicorn_log.removeFilter(quiet)
    if server.force_exit:
        raise KeyboardInterrupt(FORCED_STOP)
    if state.service.fatal_error is not None:
        raise state.service.fatal_error
