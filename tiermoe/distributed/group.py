"""The process group of a multi-rank run: who this process is, the collectives it uses, and their timeouts.

One rank per GPU, started by torchrun (or by `tiermoe serve --num-gpus N`, which sets the same environment).
Three groups, because they wait for different things:
- `data`: the per-layer all-reduce of partial expert outputs. NCCL on CUDA, gloo when the GPU tier is the host.
- `control`: gloo, always (it carries Python objects: step plans, heartbeats, swap barriers). Its own group so
  that a heartbeat sent from another thread can never interleave with a layer's all-reduce.
- `loading`: gloo with a long timeout, for the one barrier after loading (rank 0 reads every CPU expert, which
  may take many minutes on a large model, while the other ranks wait).
Every wait on `data` and `control` ends after `timeout_s`; a peer that dies closes its sockets, so gloo usually
fails at once. Either way the error becomes a RankFailure: one line that says which operation failed and why.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tiermoe.errors import TiermoeError, cause_chain

DEFAULT_DIST_TIMEOUT_S = 300.0  # longer than any one layer's CPU work, short enough to notice a hung rank
MIN_LOAD_TIMEOUT_S = 3600.0


class RankFailure(TiermoeError):
    """Another rank died or stopped answering; the run cannot go on (the process group is unusable)."""

    fatal = True  # the engine service stops the server instead of failing one request


@dataclass(frozen=True)
class RankEnv:
    """This process's place, from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, ...)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int  # torchrun's GROUP_RANK: ranks of one node share a host (and its /dev/shm)

    @classmethod
    def from_env(cls, environ=None) -> RankEnv | None:
        """None when this process was not started as a rank (no WORLD_SIZE in the environment)."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return None
        try:
            rank, world = int(env.get("RANK", "0")), int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
            local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
            node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", "0")))
        except ValueError as err:
            raise TiermoeError(f"torchrun's environment is malformed ({err})") from None
        if not 0 <= rank < world:
            raise TiermoeError(f"RANK={rank} is outside WORLD_SIZE={world}")
        return cls(rank, world, local_rank, local_world, node_rank)


def check_world(num_gpus: int, world_size: int, what: str = "--num-gpus", gpu_device: str | None = None,
                local_world_size: int | None = None) -> None:
    """The plan's GPU count and the number of processes started must agree: one rank per GPU. With
    `gpu_device`, the ranks on this node (`local_world_size`, default all) must also fit this machine
    (check_local_ranks)."""
    if num_gpus != world_size:
        raise TiermoeError(f"{what} is {num_gpus} but {world_size} processes were started (one rank per GPU): "
                           f"pass {what} {world_size}, or start {num_gpus} processes "
                           f"(torchrun --nproc-per-node {num_gpus})")
    if gpu_device is not None:
        local = world_size if local_world_size is None else local_world_size
        check_local_ranks(local, gpu_device, f"{local} ranks run on this node" if local != num_gpus else
                          f"{what} {num_gpus} starts {num_gpus} ranks")


def check_local_ranks(ranks: int, gpu_device: str, what: str) -> None:
    """Ranks on one machine are bounded by what it has: one CUDA device each, or with the GPU tier on the host
    (--gpu-device cpu) one logical CPU each. `what` names the request in the message ("--num-gpus 8 starts
    8 ranks")."""
    try:
        on_host = torch.device(gpu_device).type == "cpu"
    except (RuntimeError, TypeError):
        raise TiermoeError(f"--gpu-device '{gpu_device}' is not a device; expected cpu or cuda") from None
    if on_host:
        cpus = os.cpu_count() or 1
        if ranks > cpus:
            raise TiermoeError(f"{what}, but this machine has {cpus} CPUs (with --gpu-device cpu each rank is a "
                               f"process with its own CPU tier); use at most {cpus}")
        return
    devices = torch.cuda.device_count()
    first = first_gpu(gpu_device)
    if first + ranks > devices:
        start = f" from cuda:{first} on" if first else ""
        hint = ("; use --gpu-device cpu" if not devices else f"; use at most {devices - first}" if devices > first
                else f"; --gpu-device cuda:{first} does not exist")
        raise TiermoeError(f"{what}, one per GPU{start}, but this machine has {devices} CUDA devices{hint}")


def first_gpu(gpu_device: str) -> int:
    """The CUDA device local rank 0 uses: N of --gpu-device cuda:N, 0 for plain "cuda"."""
    return torch.device(gpu_device).index or 0


def rank_device(gpu_device: str, env: RankEnv) -> torch.device:
    """This rank's GPU tier: "cpu" for every rank, or a CUDA device per local rank, counted from the one asked
    for: --gpu-device cuda:K gives local rank r the device cuda:K+r (one rank: cuda:K itself; plain "cuda" is
    cuda:0). Refused, in one line, when this machine has too few devices from cuda:K on for its ranks."""
    device = torch.device(gpu_device)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise TiermoeError(f"--gpu-device '{gpu_device}' is not supported; expected cpu or cuda")
    if not torch.cuda.is_available():
        raise TiermoeError("--gpu-device cuda: CUDA is not available on this machine; use --gpu-device cpu")
    first, count = first_gpu(gpu_device), torch.cuda.device_count()
    if first + env.local_world_size > count:
        last = first + env.local_world_size - 1
        wanted = f"cuda:{first}" if first == last else f"cuda:{first}..cuda:{last}"
        raise TiermoeError(f"--gpu-device {gpu_device}: {env.local_world_size} rank(s) on this machine need "
                           f"{wanted}, but it has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", first + env.local_rank)


class RankGroup:
    """The initialised process group of this rank. Use as a context manager (or call close())."""

    def __init__(self, env: RankEnv, device: torch.device, timeout_s: float = DEFAULT_DIST_TIMEOUT_S):
        if timeout_s <= 0:
            raise TiermoeError(f"--dist-timeout must be > 0 seconds, got {timeout_s}")
        self.env = env
        self.device = device
        self.timeout_s = timeout_s
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {}
        if device.type == "cuda":
            torch.cuda.set_device(device)
            kwargs["device_id"] = device  # bind the NCCL communicator to this rank's GPU now
        load_timeout = datetime.timedelta(seconds=max(MIN_LOAD_TIMEOUT_S, 10 * timeout_s))
        try:
            # Meeting the other ranks may take long (they import torch, torchrun starts them one by one): the
            # rendezvous waits up to the load timeout; only the collectives use `timeout_s`.
            store, _, _ = next(dist.rendezvous("env://", rank=env.rank, world_size=env.world_size,
                                               timeout=load_timeout))
            dist.init_process_group(self.backend, store=dist.PrefixStore("default_pg", store), rank=env.rank,
                                    world_size=env.world_size, timeout=timeout, **kwargs)
            self.data = dist.group.WORLD
            self.control = dist.new_group(backend="gloo", timeout=timeout)
            self.loading = dist.new_group(backend="gloo", timeout=load_timeout)
        except (RuntimeError, ValueError) as err:
            raise RankFailure(f"rank {env.rank}: setting up the process group failed: {_first_line(err)}") from None
        self._closed = False
        self.failed = False

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fail(self, what: str, err: BaseException) -> RankFailure:
        self.failed = True
        return RankFailure(f"rank {self.rank}: {what} failed: another rank died or stopped answering "
                           f"({_first_line(err)}; collective timeout {self.timeout_s:g} s)")

    def all_reduce_sum(self, y: torch.Tensor) -> torch.Tensor:
        """Sum `y` over all ranks (in place on a contiguous tensor, which is returned)."""

        y = y.contiguous()
        try:
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.data)
        except RuntimeError as err:
            raise self._fail("a layer's all-reduce", err) from None
        return y

    def broadcast(self, obj=None, what: str = "a broadcast from rank 0"):
        """Rank 0 sends `obj` (any picklable object); every rank returns it."""

        box = [obj if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except RuntimeError as err:
            raise self._fail(what, err) from None
        return box[0]

    def barrier(self, what: str = "a barrier") -> None:
        try:
            dist.barrier(group=self.control)
        except RuntimeError as err:
            raise self._fail(what, err) from None

    def all_gather(self, obj, what: str = "an all-gather") -> list:
        out = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.control)
        except RuntimeError as err:
            raise self._fail(what, err) from None
        return out

    def gather_after_load(self, obj) -> list:
        """Every rank's `obj` once all have loaded (a long timeout: loading a large model takes minutes)."""

        out = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.loading)
        except RuntimeError as err:
            raise self._fail("waiting for every rank to load", err) from None
        return out

    def close(self) -> None:
        """Leave the process group. After a failure it is only dropped: a collective teardown with a dead peer
        could itself wait for the timeout."""

        if self._closed:
            return
        self._closed = True
        if not self.failed and dist.is_initialized():
            dist.destroy_process_group()


def fatal_cause(err: BaseException | None) -> RankFailure | None:
    """The RankFailure behind `err` (e.g. a batch aborted because one layer's all-reduce failed), if any."""
    return next((e for e in cause_chain(err) if isinstance(e, RankFailure)), None)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    # gloo prefixes messages with its source location and ends them with advice: keep the reason
    if line.startswith("[") and "] " in line:
        line = line.split("] ", 1)[1]
    return line.split(". ", 1)[0].rstrip(".")
