"""This rank's part of a multi-rank model: rank 0 gets the LLM API and the scheduler, other ranks a follower.

Start-up, on every rank of an initialised RankGroup:
1. rank 0 turns the placement into a PlacementPlan (tiermoe.model.plan_source.resolve_plan: assignment [L, E],
   -1 CPU, r GPU rank r) for exactly `world_size` GPUs and creates the shared-memory store for the CPU experts;
   it broadcasts both (or the error, so every rank fails with the same one-line message);
2. ranks on rank 0's host attach the store (mapped lazily, when a swap needs a slot);
3. every rank loads its share: non-expert weights, its own GPU experts; rank 0 also the CPU experts, into the
   store; then all ranks report to each other, so one rank's failure to load fails them all;
4. rank 0 serves (`llm`), the other ranks `follow()` until rank 0 closes.
Before rank 0's first engine step every rank may call `hybrid(...)` directly (all of them, with the same input);
after it only rank 0 drives. Followers always end in `follow()`: rank 0's close() waits for them there.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.config import DEFAULT_PAGE_SIZE, CPUConfig, PlacementConfig
from tiermoe.distributed.follower import follow
from tiermoe.distributed.group import RankGroup
from tiermoe.distributed.share import ExpertShare
from tiermoe.distributed.shm_store import SHM_DIR, SharedExpertStore
from tiermoe.distributed.step_plan import Leader
from tiermoe.engine.engine import Engine
from tiermoe.engine.llm import LLM
from tiermoe.errors import TiermoeError
from tiermoe.model.loader import load_hybrid_model
from tiermoe.model.plan_source import resolve_plan
from tiermoe.placement.budget import auto_gpu_memory
from tiermoe.stats.recording import NO_RECORDER


class RankModel:
    """Load this rank's share of `model` (see the module docstring). Use as a context manager."""

    def __init__(self, group: RankGroup, model=None, placement=None, *, dtype: torch.dtype | None = None,
                 max_running: int = 16, prefill_chunk: int = 512, max_total_tokens: int | None = None,
                 cpu: CPUConfig = CPUConfig(), recorder=NO_RECORDER, dynamic=None, progress: bool = True,
                 shm_dir=SHM_DIR, page_size: int = DEFAULT_PAGE_SIZE, prefix_cache: bool = True,
                 attention_backend: str = "auto"):
        self.group = group
        self._pool_options = dict(page_size=page_size, prefix_cache=prefix_cache)  # rank 0's; the others follow it
        self._attention_backend = attention_backend  # every rank's
        self.model_dir = resolve_model(model)
        self.llm = None
        self.engine = None
        self.hybrid = None
        self.leader = None
        self.share = None
        self._store = None
        spec = detect(load_config(self.model_dir))
        expert_dtype = dtype or spec.dtype
        try:
            setup = self._setup(placement, spec, expert_dtype, max_running, shm_dir)  # 1.
            hosts = group.all_gather(group.env.node_rank, what="exchanging hosts")
            store = self._store
            if group.rank != 0 and hosts[group.rank] == hosts[0]:  # 2.
                store = SharedExpertStore.attach(setup["store"], spec, expert_dtype, shm_dir, pin=_pins(group))
            self.share = ExpertShare(group, store, hosts)
            error = None
            try:  # 3.
                self._load(setup["plan"], dtype, setup["max_running"], prefill_chunk, max_total_tokens, cpu,
                           recorder, dynamic, progress)
            except Exception as err:  # noqa: BLE001 - every rank must learn that this one failed
                error = str(err) if isinstance(err, TiermoeError) else f"{type(err).__name__}: {err}"
            errors = group.gather_after_load(error)
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed:
                raise TiermoeError(f"rank {failed[0][0]} failed to load the model: {failed[0][1]}")
        except BaseException:
            self.leader = None  # the followers are not listening: no stop message
            self.close()
            if self.share is None and self._store is not None:
                self._store.close()
            raise

    def _setup(self, placement, spec, expert_dtype, max_running, shm_dir) -> dict:
        group = self.group
        setup = None
        # --gpu-memory-gb auto sizes every rank's share by what its own GPU has free, not by rank 0's
        own = own_gpu_memory(placement, group.device)
        measured = group.all_gather(own, what="measuring GPU memory") if own is not None else None
        if group.rank == 0:
            try:
                errors = [m for m in measured or () if isinstance(m, str)]
                if errors:
                    raise TiermoeError(errors[0])
                plan = resolve_plan(placement, self.model_dir, spec, group.world_size, str(group.device), measured)
                cpu_experts = int(((plan.assignment == -1) & spec.moe_row_mask()[:, None]).sum())
                needed = cpu_experts * spec.bytes_per_expert(expert_dtype)
                self._store = SharedExpertStore.create(spec, expert_dtype, needed, shm_dir, pin=_pins(group))
                setup = {"plan": plan, "store": self._store.name, "max_running": max_running}
            except TiermoeError as err:
                setup = {"error": str(err)}
        setup = group.broadcast(setup, what="start-up")
        if "error" in setup:
            raise TiermoeError(setup["error"])
        return setup

    def _load(self, plan, dtype, max_running, prefill_chunk, max_total_tokens, cpu, recorder, dynamic,
              progress) -> None:
        device = str(self.group.device)
        if self.group.rank == 0:
            self.llm = LLM(self.model_dir, gpu_device=device, placement=plan, dtype=dtype, max_running=max_running,
                           prefill_chunk=prefill_chunk, max_total_tokens=max_total_tokens, cpu=cpu,
                           **self._pool_options, attention_backend=self._attention_backend,
                           recorder=recorder, dynamic=dynamic, progress=progress, share=self.share)
            self.hybrid, self.engine = self.llm.hybrid, self.llm.engine
            self.leader = self.share.leader = self.engine.leader = Leader(self.share, self.hybrid)
            self.group.broadcast(replace(self.engine.config, max_total_tokens=self.engine.pool.tokens),
                                 what="sizing the KV pool")
        else:
            self.hybrid = load_hybrid_model(self.model_dir, plan, gpu_device=device, dtype=dtype, cpu=cpu,
                                            progress=False, share=self.share,
                                            attention_backend=self._attention_backend)
            # rank 0's steps carry its page tables: every rank's pool has rank 0's size and page layout
            leader_config = self.group.broadcast(what="sizing the KV pool")
            self.engine = Engine(self.hybrid, config=leader_config)

    @property
    def rank(self) -> int:
        return self.group.rank

    def follow(self) -> int:
        """Followers: run rank 0's steps until it closes; returns the steps run."""
        if self.group.rank == 0:
            raise RuntimeError("rank 0 leads; only the other ranks follow")
        return follow(self.engine, self.share)

    def close(self) -> None:
        """Rank 0 tells the followers to stop; every rank releases its model; rank 0 removes the shared files."""
        try:
            if self.leader is not None:
                self.leader.close()
        finally:
            if self.llm is not None:
                self.llm.close()
            elif self.engine is not None:
                self.engine.close()
                self.hybrid.close()
            if self.share is not None:
                self.share.close()
            self.llm = self.engine = self.hybrid = self.leader = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def own_gpu_memory(placement, device: torch.device) -> tuple[int, int] | str | None:
    """This rank's (free bytes, margin) on its own GPU when `placement` sizes the GPU tier by --gpu-memory-gb auto
    (the error's line where it cannot be measured, so rank 0 fails every rank with it); None otherwise. Every
    rank decides alike: they all get the same placement."""
    if not (isinstance(placement, PlacementConfig) and placement.gpu_memory_gb == "auto"):
        return None
    try:
        return auto_gpu_memory(str(device))
    except TiermoeError as err:
        return str(err)


def _pins(group: RankGroup) -> bool:
    """Page-lock the shared expert slots this process copies to or from its GPU (cudaHostRegister, slot by slot),
    so swap copies are not pageable: only when the GPU tier is on CUDA."""
    return group.device.type == "cuda"
