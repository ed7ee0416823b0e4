"""tiermoe serve: the OpenAI- and Ollama-compatible HTTP server with continuous batching.

One process by default. With --num-gpus N > 1 (or a plan for N GPUs) it runs one rank per GPU: under torchrun
(`torchrun --nproc-per-node N -m tiermoe.serve ...`) this process is one of them; otherwise it starts the other
N - 1 ranks itself and becomes rank 0 (tiermoe.distributed). Rank 0 serves HTTP, the others follow its steps.
"""

from __future__ import annotations

import argparse
import signal

from tiermoe.cli.cpu_flags import add_cpu_flags, cpu_from_args
from tiermoe.cli.flags import add_command, positive_int
from tiermoe.cli.generate_cmd import add_model_flags
from tiermoe.cli.placement_flags import (
    add_dynamic_flags,
    add_placement_flags,
    check_fit_from_args,
    dynamic_from_args,
    placement_from_args,
)
from tiermoe.cli.recorder_flags import add_recorder_flags, recorder_from_args
from tiermoe.cli.sglang_flags import add_sglang_compat_flags, report_ignored
from tiermoe.distributed.group import DEFAULT_DIST_TIMEOUT_S


def add_parser(sub) -> None:
    p = add_command(
        sub, "serve",
        "Serve a hybrid model over HTTP: OpenAI /v1/chat/completions, /v1/completions, /v1/models; Ollama "
        "/api/chat, /api/generate, /api/tags; /health, /metrics, /placement and SGLang's expert distribution "
        "recorder endpoints. Concurrent requests share forward passes (continuous batching). Without --model, "
        "the bundled demo model. SGLang-kt spellings (--model-path, --kt-gpu-device, --kt-...) are accepted.",
        "tiermoe serve",
        "tiermoe serve --model /models/Qwen3-30B-A3B --gpu-device cuda:0 --kt-num-gpu-experts 32 --port 30000",
        "tiermoe serve --model-path /models/DeepSeek-V3 --kt-gpu-device cuda:0 --kt-expert-placement-strategy "
        "frequency --init-expert-location stats.pt --kt-gpu-experts-ratio 0.2 --api-key secret",
        "tiermoe serve --model /models/DeepSeek-V3 --gpu-device cuda --num-gpus 4 --kt-gpu-experts-ratio 0.3",
        "torchrun --nproc-per-node 4 -m tiermoe.serve --model /models/DeepSeek-V3 --gpu-device cuda --num-gpus 4 "
        "--plan plan.json",
    )
    add_serve_flags(p)


def seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number of seconds") from None
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value}")
    return number


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `tiermoe serve` (also parsed by `python -m tiermoe.serve`, the torchrun entry point)."""
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=positive_int, default=30000, help="port (default 30000)")
    p.add_argument("--served-model-name", help="model name reported by /v1/models (default: the directory name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--max-running-requests", type=positive_int, default=32,
                   help="requests decoded together at most; more wait in a queue (default 32)")
    p.add_argument("--chunked-prefill-size", type=positive_int, default=512,
                   help="prompt tokens prefilled per step over all requests (default 512)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of requests that give none (default 256)")
    add_placement_flags(p)
    add_dynamic_flags(p)
    add_cpu_flags(p)
    add_recorder_flags(p)
    add_sglang_compat_flags(p)
    g = p.add_argument_group("several GPUs (one rank per GPU; see docs/multi-gpu.md)")
    g.add_argument("--dist-timeout", dest="dist_timeout", type=seconds, default=DEFAULT_DIST_TIMEOUT_S,
                   help="seconds a rank waits for the others in one collective before it gives up with an error "
                        "(a rank died or hangs); idle ranks exchange heartbeats, so idleness never trips it "
                        f"(default {DEFAULT_DIST_TIMEOUT_S:g})")


def build_state(args, llm=None):
    from tiermoe.config import ServerConfig, check_device
    from tiermoe.engine.llm import LLM
    from tiermoe.server.engine_service import EngineService
    from tiermoe.server.metrics import ServerMetrics
    from tiermoe.server.state import ServerState
    from tiermoe.stats.tier_hits import TierHitCounter

    config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                          api_key=args.api_key, max_running_requests=args.max_running_requests,
                          max_total_tokens=args.max_total_tokens, chunked_prefill_size=args.chunked_prefill_size,
                          default_max_tokens=args.default_max_tokens)
    if llm is None:
        device = check_device(args.gpu_device)
        placement = placement_from_args(args)
        check_fit_from_args(args, placement, device)
        llm = LLM(args.model, gpu_device=device, placement=placement,
                  dynamic=dynamic_from_args(args), max_running=config.max_running_requests,
                  prefill_chunk=config.chunked_prefill_size, max_total_tokens=config.max_total_tokens,
                  cpu=cpu_from_args(args))
    hits = TierHitCounter(llm.hybrid.spec.num_layers, llm.hybrid.gpu_device)
    llm.engine.add_recorder(hits)
    control = None
    if getattr(args, "recorder_mode", None):
        from tiermoe.stats.control import RecorderControl

        recorder = recorder_from_args(args, llm.hybrid.spec)
        llm.engine.add_recorder(recorder)
        control = RecorderControl(recorder)  # starts stopped, as in SGLang: /start_expert_distribution_record
    metrics = ServerMetrics()
    detokenize = llm.engine.detokenize
    service = EngineService(llm.engine, detokenize, metrics)
    name = config.served_model_name or llm.model_dir.name
    return ServerState(llm=llm, config=config, service=service, metrics=metrics, hits=hits, model_name=name,
                       recorder_control=control)


def requested_gpus(args) -> int:
    """The GPU count the flags ask for: the plan's, else --num-gpus."""
    if getattr(args, "plan", None):
        from tiermoe.placement.plan import PlacementPlan

        return PlacementPlan.load(args.plan).num_gpus
    return args.num_gpus


def run(args) -> int:
    from tiermoe.distributed.group import RankEnv, check_world
    from tiermoe.server.malloc_arenas import limit_malloc_arenas

    limit_malloc_arenas()  # before any thread starts: keeps RSS flat after bursts of requests
    env = RankEnv.from_env()
    if env is None or env.rank == 0:
        report_ignored(args)
    gpus = requested_gpus(args)
    if env is not None:  # started by torchrun (or by our own launcher)
        check_world(gpus, env.world_size, "--num-gpus" if not args.plan else "the plan's num_gpus")
    if env is not None and env.world_size > 1:
        from tiermoe.distributed.serve_rank import serve_rank

        return serve_rank(args, env)
    if env is None and gpus > 1:
        from tiermoe.distributed.launch import serve_with_local_ranks

        return serve_with_local_ranks(args, gpus)
    state = build_state(args)
    try:
        serve(state)
    finally:
        state.llm.close()
    return 0


def serve(state) -> None:
    """Serve HTTP until Ctrl-C / SIGTERM (then drain), or until the engine fails for good (then raise that)."""
    import uvicorn

    from tiermoe.server.app import create_app

    class DrainingServer(uvicorn.Server):
        """Ctrl-C / SIGTERM: stop accepting, let running requests finish, exit with status 0. (uvicorn re-raises
        the signal after its graceful shutdown, which would end the process as killed by it.)"""

        def handle_exit(self, sig, frame) -> None:
            self.force_exit = self.should_exit and sig == signal.SIGINT  # a second Ctrl-C stops at once
            self.should_exit = True

    print(f"serving {state.model_name} on http://{state.config.host}:{state.config.port} "
          f"(OpenAI: /v1, Ollama: /api, metrics: /metrics)", flush=True)
    config = uvicorn.Config(create_app(state), host=state.config.host, port=state.config.port, log_level="info",
                            timeout_graceful_shutdown=60)
    server = DrainingServer(config)

    def stop_serving(err) -> None:  # called from the engine thread: uvicorn polls should_exit
        server.should_exit = True

    state.service.on_fatal = stop_serving
    server.run()
    if state.service.fatal_error is not None:
        raise state.service.fatal_error
