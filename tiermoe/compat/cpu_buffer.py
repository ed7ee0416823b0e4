"""KTransformers' KExpertsCPUBuffer: the host side of the CPU-expert path, one copy per host, pinned under CUDA.

kt-kernel's KExpertsCPUBuffer is the pinned host staging area its CPU experts compute from: per batch size,
`buffer_depth` (2) sets of hidden-state input, immediate and deferred expert ids, routing weights, output and a
batch-size scalar, plus an output on the device, so that layer i fills one set while layer i-1's is still in use;
batch sizes listed in `capture_bs` keep their buffers (CUDA graphs replay fixed addresses).

tiermoe's KExpertsCPUBuffer offers that staging surface (`get_buffer`, `buffer_depth`, `capture_bs`,
`set_capture_batch_sizes`, `clear_buffer_cache`), and also holds what the CPU experts compute with: their weights,
in the shared-memory store of the multi-GPU engine (tiermoe.distributed.shm_store.SharedExpertStore, the same
code, not a copy of it). One process creates the buffer; the other ranks of the host `attach` it by name and map
the same pages, so the host holds each CPU expert once whatever the number of ranks. With CUDA present every
slot in use is page-locked (cudaHostRegister), so copies to a GPU are asynchronous DMA; without CUDA nothing is
pinned (KTransformers would fail to allocate).

Differences from kt-kernel, on purpose:
- state lives in the object, not in class attributes (no process-global buffers shared by unrelated models);
- staging buffers are keyed by the whole shape (batch size, hidden size, top-k, dtype, device), not by batch
  size alone, so a second model never gets another's buffers; they take the hidden states' dtype (kt-kernel
  always uses bf16 because its kernels do).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from tiermoe.arch import detect, load_config
from tiermoe.checkpoint.fp8 import fp8_block_size
from tiermoe.distributed.shm_store import SHM_DIR, SharedExpertStore
from tiermoe.errors import TiermoeError
from tiermoe.experts.weights import ExpertWeights
from tiermoe.model.expert_source import LAYERS_PREFIX, find_expert_source, read_expert
from tiermoe.model.gguf_checkpoint import open_checkpoint


class StagingBuffers(NamedTuple):
    """One batch size's staging area, `buffer_depth` tensors per field (unpacks like kt-kernel's 7-tuple)."""

    input_cpu: list[torch.Tensor]  # [B, H] hidden states
    immediate_ids_cpu: list[torch.Tensor]  # [B, K] int64 expert ids computed now
    deferred_ids_cpu: list[torch.Tensor]  # [B, K] int64 expert ids deferred to the next layer (-1 = none)
    weights_cpu: list[torch.Tensor]  # [B, K] fp32 routing weights
    output_cpu: list[torch.Tensor]  # [B, H] the CPU experts' weighted sum
    bsz_cpu: list[torch.Tensor]  # [1] int32 batch size (kernels read it at run time)
    output_gpu: list[torch.Tensor]  # [B, H] on the hidden states' device


class KExpertsCPUBuffer:
    """The CPU-tier experts of one model in shared memory, plus kt-kernel's staging buffers.

    Make one with `create` (empty; fill with `put`), `from_checkpoint` (the CPU experts of a placement, read from
    disk), `attach` (another process's buffer, by `name`) or `of` (the buffer of a running multi-rank model).
    """

    buffer_depth = 2  # staging sets: the layer being filled and the one being computed

    def __init__(self, store: SharedExpertStore, owns_store: bool = True):
        self.store = store
        self._owns_store = owns_store  # False for `of`: the engine closes its own store
        self.capture_bs: list[int] = []
        self._captured: dict[tuple, StagingBuffers] = {}
        self._temp: tuple[tuple, StagingBuffers] | None = None

    # --- making one -----------------------------------------------------------------------------------------
    @classmethod
    def create(cls, model, dtype: torch.dtype | None = None, gpu_experts_mask=None, *, pin: bool | None = None,
               directory: str | Path = SHM_DIR) -> KExpertsCPUBuffer:
        """An empty buffer with a slot for every routed expert of `model` (a checkpoint directory, a transformers
        config, or a model with `.config`). Memory is taken only by the slots written, but the host must have
        room for the CPU experts of `gpu_experts_mask` ([L, E] bool, True = GPU tier; None = all on the CPU).
        `pin`: page-lock the slots; default: when CUDA is available."""
        spec = _spec(model)
        dtype = dtype or spec.dtype
        needed = int(cpu_experts(spec, gpu_experts_mask).sum()) * spec.bytes_per_expert(dtype)
        return cls(SharedExpertStore.create(spec, dtype, needed, directory, pin=_pin(pin)))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, gpu_experts_mask=None, dtype: torch.dtype | None = None, *,
                        pin: bool | None = None, directory: str | Path = SHM_DIR) -> KExpertsCPUBuffer:
        """A buffer holding the CPU experts of `gpu_experts_mask` (False positions of MoE layers), read from the
        checkpoint (safetensors, FP8 or GGUF, opened as the loader opens it) in tiermoe's canonical layout."""

        buffer = cls.create(model_dir, dtype, gpu_experts_mask, pin=pin, directory=directory)
        try:
            spec, on_cpu = buffer.store.spec, cpu_experts(buffer.store.spec, gpu_experts_mask)
            config = load_config(model_dir)
            with open_checkpoint(model_dir, config, fp8_block_size(config)) as ckpt:
                for layer in spec.moe_layers:
                    source = find_expert_source(ckpt, spec, LAYERS_PREFIX, layer)
                    for expert in on_cpu[layer].nonzero().flatten().tolist():
                        buffer.put(layer, expert, read_expert(ckpt, source, expert, spec, buffer.dtype))
        except BaseException:
            buffer.close()
            raise
        return buffer

    @classmethod
    def attach(cls, name: str, model, dtype: torch.dtype | None = None, *, pin: bool | None = None,
               directory: str | Path = SHM_DIR) -> KExpertsCPUBuffer:
        """The buffer `name` that another process of this host created (same model and dtype)."""
        spec = _spec(model)
        store = SharedExpertStore.attach(name, spec, dtype or spec.dtype, directory, pin=_pin(pin))
        if not store.path(spec.moe_layers[0]).exists():
            raise TiermoeError(f"no CPU expert buffer '{name}' in {directory} (has its creator closed it?)")
        return cls(store)

    @classmethod
    def of(cls, rank_model) -> KExpertsCPUBuffer:
        """The buffer a multi-rank model (tiermoe.distributed.RankModel, or its ExpertShare) keeps its CPU experts
        in; closing this view leaves the model's memory alone."""
        share = getattr(rank_model, "share", rank_model)
        if getattr(share, "store", None) is None:
            raise TiermoeError("this rank has no shared CPU expert buffer (it runs on another host than rank 0)")
        return cls(share.store, owns_store=False)

    # --- the experts ----------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """What other processes pass to `attach`."""
        return self.store.name

    @property
    def dtype(self) -> torch.dtype:
        return self.store.dtype

    @property
    def pinned(self) -> bool:
        return self.store.pin

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert's slot takes (its tensors, rounded up to whole pages)."""
        return self.store.slot_elems * self.dtype.itemsize

    @property
    def capacity_nbytes(self) -> int:
        """Bytes if every routed expert were written (the files' sizes)."""
        return self.expert_nbytes * self.store.spec.num_experts * self.store.spec.num_moe_layers

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the buffer holds now (written slots only)."""
        return self.store.allocated_bytes()

    def put(self, layer: int, expert: int, weights: ExpertWeights) -> ExpertWeights:
        """Copy an expert (canonical layout: gate_up [2I, H], down [H, I], biases) into its slot; returns the
        slot's views, which every process of the buffer sees."""
        self._check(layer, expert)
        return self.store.write(layer, expert, weights)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """Views of an expert's slot (zeros if nobody wrote it)."""
        self._check(layer, expert)
        return self.store.slot(layer, expert)

    def release(self, layer: int, expert: int) -> None:
        """Give the slot's memory back to the host (the expert moved to a GPU)."""
        self._check(layer, expert)
        self.store.release(layer, expert)

    def _check(self, layer: int, expert: int) -> None:
        spec = self.store.spec
        if layer not in spec.moe_layers:
            raise TiermoeError(f"layer {layer} is not a MoE layer of this {spec.model_type} model "
                               f"(MoE layers: {list(spec.moe_layers)})")
        if not 0 <= expert < spec.num_experts:
            raise TiermoeError(f"expert {expert} is out of range: the model has {spec.num_experts} experts per layer")

    # --- kt-kernel's staging surface ---------------------------------------------------------------------------
    def set_capture_batch_sizes(self, capture_bs) -> None:
        """Batch sizes whose staging buffers are kept for good (kt-kernel: for CUDA graph capture)."""
        self.capture_bs = list(capture_bs)

    def get_buffer(self, hidden_states: torch.Tensor, num_experts_per_tok: int) -> StagingBuffers:
        """The staging buffers for `hidden_states` [B, H]: a captured batch size's own, else the last one made
        while the shape stays the same, else new ones (pinned when CUDA is available)."""
        batch, hidden = hidden_states.shape[0], hidden_states.shape[-1]
        key = (batch, hidden, num_experts_per_tok, hidden_states.dtype, hidden_states.device)
        if key in self._captured:
            return self._captured[key]
        if self._temp is not None and self._temp[0] == key:
            return self._temp[1]
        buffers = _staging(batch, hidden, num_experts_per_tok, hidden_states.dtype, hidden_states.device,
                           self.buffer_depth, pin=torch.cuda.is_available())
        if batch in self.capture_bs:
            self._captured[key] = buffers
        self._temp = (key, buffers)
        return buffers

    def clear_buffer_cache(self) -> None:
        """Drop every staging buffer (the expert slots stay)."""
        self._captured.clear()
        self._temp = None

    # --- life cycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap (and, for the creator, remove) the shared files; the memory returns to the host once no process
        maps them."""
        self.clear_buffer_cache()
        if self._owns_store:
            self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def cpu_experts(spec, gpu_experts_mask=None) -> torch.Tensor:
    """bool [L, E]: the routed experts on the CPU tier (MoE layers only; KTransformers' dense rows are ignored)."""
    rows = spec.moe_row_mask()[:, None].expand(spec.num_layers, spec.num_experts)
    if gpu_experts_mask is None:
        return rows.clone()
    mask = torch.as_tensor(gpu_experts_mask)
    if tuple(mask.shape) != (spec.num_layers, spec.num_experts):
        raise TiermoeError(f"gpu_experts_mask has shape {list(mask.shape)}, expected "
                           f"[{spec.num_layers}, {spec.num_experts}] for this model")
    return rows & ~mask.bool()


def _spec(model):
    if isinstance(model, (str, Path)):
        return detect(load_config(model))
    return detect(getattr(model, "config", model))


def _pin(pin: bool | None) -> bool:
    return torch.cuda.is_available() if pin is None else pin


def _staging(batch: int, hidden: int, k: int, dtype: torch.dtype, device: torch.device, depth: int,
             pin: bool) -> StagingBuffers:
    def host(shape, dtype, fill=0):
        return [torch.full(shape, fill, dtype=dtype, pin_memory=pin) for _ in range(depth)]

    return StagingBuffers(
        input_cpu=host((batch, hidden), dtype),
        immediate_ids_cpu=host((batch, k), torch.int64),
        deferred_ids_cpu=host((batch, k), torch.int64, fill=-1),
        weights_cpu=host((batch, k), torch.float32),
        output_cpu=host((batch, hidden), dtype),
        bsz_cpu=host((1,), torch.int32, fill=batch),
        output_gpu=[torch.zeros((batch, hidden), dtype=dtype, device=device) for _ in range(depth)],
    )
