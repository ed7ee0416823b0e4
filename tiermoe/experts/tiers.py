"""The two tiers of one MoE layer's experts.

`ExpertSet` is what a tier holds: expert id -> weights on one device. The GPU tier computes synchronously on
its device. The CPU tier computes on a worker thread behind the `submit` / `sync` protocol, so the layer can run
the GPU part meanwhile. The worker is owned by the loaded model (one per model, passed in; never a global).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Protocol

import torch

from tiermoe.experts.ffn import ExpertActivation, routed_experts_forward
from tiermoe.experts.weights import ExpertWeights


class CPUExpertBackend(Protocol):
    """What a HybridMoE block needs from its CPU tier: the experts it holds, and computing with them.

    submit(x_TD, ids_TK, weights_TK): start computing, for each token, the weighted sum of its routed experts
    whose id is >= 0 (ids -1 belong to the GPU tier); inputs are host tensors. sync() -> y_TD waits and returns it.
    start(...) queues the same computation as a job of its own and returns its Future (deferred experts): jobs
    run one after another on the model's worker, in the order they were queued.
    drain() ends a submitted job without its result: the caller's own work failed between submit and sync.
    add(e, weights) takes an expert in tiermoe's canonical layout and stores it in the backend's own format
    (quantising if that format is int8/int4); get(e) gives it back in the canonical layout (dequantised), so an
    expert can move to the GPU tier; pop(e) also releases it. nbytes counts what the backend really holds.
    A backend whose format does not survive the round trip (int4: quantising the dequantised copy again moves
    codes) keeps a popped expert's stored form: parked(e) says so, and restore(e) takes it back as it was, in
    place of add (no copy, no conversion).
    """

    device: torch.device
    pin: bool

    def submit(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
               out: torch.Tensor | None = None) -> None: ...

    def sync(self) -> torch.Tensor: ...

    def drain(self) -> None: ...

    def start(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> Future: ...

    def compute_here(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor: ...

    def add(self, expert: int, weights: ExpertWeights) -> None: ...

    def get(self, expert: int) -> ExpertWeights: ...

    def pop(self, expert: int) -> ExpertWeights: ...

    def parked(self, expert: int) -> bool: ...

    def restore(self, expert: int) -> None: ...

    def __contains__(self, expert: int) -> bool: ...

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class ExpertSet:
    """The experts one tier holds for one layer, all on `device` (host copies pinned when `pin`)."""

    def __init__(self, device: torch.device | str, act: ExpertActivation, pin: bool = False):
        self.device = torch.device(device)
        self.act = act
        self.pin = pin
        self.experts: dict[int, ExpertWeights] = {}

    def __contains__(self, expert: int) -> bool:
        return expert in self.experts

    def __len__(self) -> int:
        return len(self.experts)

    def add(self, expert: int, weights: ExpertWeights) -> None:
        if weights.device.type != self.device.type:
            raise ValueError(f"expert {expert} is on {weights.device}, this tier is {self.device}")
        self.experts[expert] = weights

    def get(self, expert: int) -> ExpertWeights:
        return self.experts[expert]

    def pop(self, expert: int) -> ExpertWeights:
        return self.experts.pop(expert)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.experts.values())

    def make_room(self, experts: int) -> None:
        """Get ready to take `experts` more: nothing to do (each expert is its own allocation)."""

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        return routed_experts_forward(self.experts, x_TD, ids_TK, weights_TK, self.act)


class CPUWorker:
    """One thread that runs CPU-tier expert work for all layers of a model; torch's own intra-op threads do the math."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiermoe-cpu-experts")
        self._shared: dict = {}
        self._shared_lock = threading.Lock()  # training's products ask for the kernel team from other threads

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def shared(self, key, make):
        """A resource all layers' backends share (e.g. a kernel thread team): made by `make()` on first request,
        closed with the worker. Owned here because the worker is the thread that mostly uses it."""
        with self._shared_lock:
            if key not in self._shared:
                self._shared[key] = make()
            return self._shared[key]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for resource in self._shared.values():
            close = getattr(resource, "close", None)
            if close is not None:
                close()
        self._shared.clear()


class ComputedOnWorker:
    """submit / sync for a CPU tier whose `_compute(x_TD, ids_TK, weights_TK) -> y_TD` runs on its CPUWorker
    thread: one call in flight at a time, so the layer's GPU part runs while the CPU part computes."""

    worker: CPUWorker
    _pending: Future | None = None

    def submit(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
               out: torch.Tensor | None = None) -> None:
        """Start the layer's CPU part; `sync` returns its result, written into `out` [T, D] when given (a
        page-locked buffer the result goes back to the GPU from: tiermoe.layers.host_ring)."""
        if self._pending is not None:
            raise RuntimeError("submit called twice without sync")
        self._pending = self.worker.submit(self._compute_into, x_TD, ids_TK, weights_TK, out)

    def start(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> Future:
        """The same computation as a job of its own, outside submit/sync (the caller keeps its Future)."""
        return self.worker.submit(self._compute, x_TD, ids_TK, weights_TK)

    def compute_here(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The same computation on the calling thread, for a caller with nothing to overlap with it: a job handed
        to the worker and its result handed back cost two thread wake-ups (per MoE layer of a decode step)."""
        if self._pending is not None:
            raise RuntimeError("compute_here called while a submitted job is pending")
        return self._compute(x_TD, ids_TK, weights_TK)

    def _compute_into(self, x_TD, ids_TK, weights_TK, out):
        if out is None:  # the CPU main device's path: no staging buffer, the call as it always was
            return self._compute(x_TD, ids_TK, weights_TK)
        y_TD = self._compute(x_TD, ids_TK, weights_TK, out)  # a backend that can, writes into `out` itself
        if y_TD.data_ptr() == out.data_ptr():
            return y_TD
        with torch.inference_mode():  # `out` is a view made inside the forward's inference mode
            return out.copy_(y_TD)

    def sync(self) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("sync called without submit")
        return pending.result()

    def drain(self) -> None:
        """End the submitted job, if any, and drop its result (and its error: the caller's is the one to report).
        Waits for a job already running, so nothing of a failed forward still runs when the next one starts."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.cancel():
            wait([pending])


class TorchCPUExperts(ComputedOnWorker, ExpertSet):
    """The plain-torch CPU tier: the reference every faster backend is checked against."""

    def __init__(self, worker: CPUWorker, act: ExpertActivation, pin: bool = False):
        super().__init__("cpu", act, pin)
        self.worker = worker

    def parked(self, expert: int) -> bool:
        return False  # the checkpoint's own dtype: a round trip gives the expert back exactly

    def _compute(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        with torch.inference_mode():
            return self.forward(x_TD, ids_TK, weights_TK)
