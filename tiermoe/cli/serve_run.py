"""tiermoe serve, run (its flags: tiermoe.cli.serve_cmd): the OpenAI- and Ollama-compatible HTTP server with
continuous batching.

One process by default. With --num-gpus N > 1 (or a plan for N GPUs) it runs one rank per GPU: under torchrun
(`torchrun --nproc-per-node N -m tiermoe.serve ...`) this process is one of them; otherwise it starts the other
N - 1 ranks itself and becomes rank 0 (tiermoe.distributed). Rank 0 serves HTTP, the others follow its steps.
"""

from __future__ import annotations

import logging

from tiermoe.cli.cpu_flags import cpu_from_args
from tiermoe.cli.listen_address import check_listen_address
from tiermoe.cli.lora_args import lora_choice
from tiermoe.cli.placement_flags import dynamic_from_args
from tiermoe.cli.serve_flags import server_config_from_args
from tiermoe.cli.serve_http import build_state, serve, show_tiermoe_logs
from tiermoe.cli.serve_ranks import leave_on_rank_failure, serve_rank, serve_with_local_ranks
from tiermoe.cli.sglang_flags import report_ignored
from tiermoe.config import raise_open_files_limit
from tiermoe.distributed.group import RankEnv, check_local_ranks, check_world
from tiermoe.engine.device_errors import DeviceLostError
from tiermoe.errors import TiermoeError
from tiermoe.placement.plan import PlacementPlan
from tiermoe.server.engine_service import StuckStepError
from tiermoe.server.malloc_arenas import limit_malloc_arenas

log = logging.getLogger(__name__)


def requested_gpus(args) -> int:
    """The GPU count the flags ask for: the plan's, else --num-gpus."""
    if getattr(args, "plan", None):
        return PlacementPlan.load(args.plan).num_gpus
    return args.num_gpus


def raise_open_files() -> None:
    raised = raise_open_files_limit()
    if raised is not None:
        log.info("open-file limit (ulimit -n) raised from %d to %d: each connection holds a file descriptor", *raised)


def run(args) -> int:
    limit_malloc_arenas()  # before any thread starts: keeps RSS flat after bursts of requests
    show_tiermoe_logs()  # dynamic expert updates and the like, one INFO line each
    raise_open_files()  # before the flags are checked: requests in flight are bounded by the open-file limit
    env = RankEnv.from_env()
    if env is None or env.rank == 0:
        report_ignored(args)
        server_config_from_args(args)  # a bad setting or unreadable key file fails now, not after minutes of loading
        lora_choice(args)  # so does a bad adapter name
        dynamic_from_args(args)  # so do placement flags that contradict each other
        cpu_from_args(args)  # so do CPU-tier settings that disagree
        check_listen_address(args.host, args.port)  # so does a host or a port it cannot listen on
    choice = lora_choice(args)
    gpus = requested_gpus(args)
    if (choice.merged or choice.per_request) and gpus > 1:
        raise TiermoeError("--lora serves in one process (one GPU); several ranks take no adapter yet (merged or "
                           "per request)")
    what = "--num-gpus" if not args.plan else "the plan's num_gpus"
    if env is not None:  # started by torchrun (or by our own launcher)
        check_world(gpus, env.world_size, what, args.gpu_device, env.local_world_size)
    if env is not None and env.world_size > 1:
        return leave_on_rank_failure(serve_rank, args, env)
    if env is None and gpus > 1:
        check_local_ranks(gpus, args.gpu_device, f"{what} {gpus} starts {gpus} ranks")  # before starting any
        return leave_on_rank_failure(serve_with_local_ranks, args, gpus)
    state = build_state(args)
    try:
        serve(state)
    finally:
        # a stuck step still holds the model; a poisoned GPU context fails every call, a close's included
        if not isinstance(state.service.fatal_error, (StuckStepError, DeviceLostError)):
            state.llm.close()
    return 0
