"""Page-locked host memory for the CPU tier: one slab per layer, pinned once, and only when it pays.

Why not pin expert by expert: PyTorch's caching host allocator rounds every pinned block up to a power of two
and never gives it back (Qwen3-30B's gate_up, 6 MiB, takes 8; down, 3 MiB, takes 4: 1.33x the CPU tier), and a
CPU tier on a host GPU device (gpu_device "cpu") copies nothing over PCIe at all. So:
- pin only when the GPU tier is a CUDA device (`pins_host_memory`);
- only for a tier that computes from the tensors it is given (an ExpertSet: the torch backend); a backend that
  converts each expert into its own format (native, kt) copies it away, so its experts are read into plain
  memory and it pins nothing but the transient copy a swap moves;
- one pageable allocation per layer, exactly the size of its CPU experts, page-locked in place with
  cudaHostRegister (no rounding; unlocked when the slab goes); each expert is a view of one slot.
Swaps reuse slots: a slot is free once its tier no longer holds the expert there, and a demotion lands in a
free slot when the layer has one (else in a block of the caching allocator, as before).
The shared-memory store of several ranks (tiermoe.distributed.shm_store) locks its slots with the same calls.
"""

from __future__ import annotations

import math
import weakref

import torch

from tiermoe.errors import TiermoeError
from tiermoe.experts.weights import ExpertWeights


def pins_host_memory(gpu_device: str | torch.device) -> bool:
    """Whether CPU-tier experts are worth page-locking: they cross PCIe only when the GPU tier is on CUDA."""
    return torch.device(gpu_device).type == "cuda"


def expert_shapes(spec) -> list[tuple[int, ...]]:
    """The canonical tensors of one expert: gate_up [2I, H] (up [I, H] for experts without a gate), down [H, I],
    (gate_up_bias [2I], down_bias [H])."""
    h, i = spec.hidden_size, spec.expert_intermediate_size
    rows = getattr(spec, "gate_up_rows", 2 * i)
    shapes = [(rows, h), (h, i)]
    if spec.expert_bias:
        shapes += [(rows,), (h,)]
    return shapes


def register_host(address: int, nbytes: int, cuda=torch.cuda) -> None:
    """Page-lock [address, address + nbytes) for fast, asynchronous copies to the GPU (cudaHostRegister; `cuda`:
    torch.cuda, or tiermoe.testing.fake_cuda's stand-in)."""
    portable = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process, not just the current
    code = int(cuda.cudart().cudaHostRegister(address, nbytes, portable))
    if code != 0:
        raise TiermoeError(f"could not pin {nbytes} bytes of expert memory (cudaHostRegister error {code}); "
                           "the locked-memory limit (ulimit -l) may be too low")


def unregister_host(address: int, cuda=torch.cuda) -> None:
    cuda.cudart().cudaHostUnregister(address)


def _unlock(flat: torch.Tensor, cuda) -> None:
    # the finalizer holds `flat` until the slab is gone, so its memory is unlocked before it can be freed
    unregister_host(flat.data_ptr(), cuda)


class HostSlab:
    """`slots` experts of `shapes` in `dtype`, in one host allocation (page-locked through `cuda` when `pin`)."""

    def __init__(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, slots: int, pin: bool, cuda=torch.cuda):
        self.shapes = shapes
        self.slot_elems = sum(math.prod(s) for s in shapes)
        self.flat = torch.empty(slots * self.slot_elems, dtype=dtype)
        self.nbytes = self.flat.nbytes
        self.pinned = pin and self.nbytes > 0
        if self.pinned:
            register_host(self.flat.data_ptr(), self.nbytes, cuda)
            weakref.finalize(self, _unlock, self.flat, cuda)  # the unlock that matches this lock
        self._expert: list[int | None] = [None] * slots  # the expert each slot was last given to
        self._reserved: set[int] = set()  # slots given to a copy that has not landed in its tier yet

    def __len__(self) -> int:
        return len(self._expert)

    def slot(self, index: int) -> ExpertWeights:
        base, views = index * self.slot_elems, []
        for shape in self.shapes:
            n = math.prod(shape)
            views.append(self.flat[base:base + n].view(shape))
            base += n
        return ExpertWeights(*views)

    def holds(self, weights: ExpertWeights) -> bool:
        start, ptr = self.flat.data_ptr(), weights.gate_up.data_ptr()
        return start <= ptr < start + self.nbytes

    def take(self, expert: int, tier) -> ExpertWeights | None:
        """A free slot for `expert` (its views; write it, then add it to `tier`), or None when all are in use."""
        for index in range(len(self._expert)):
            if self._free(index, tier):
                self._expert[index] = expert
                self._reserved.add(index)
                return self.slot(index)
        return None

    def _free(self, index: int, tier) -> bool:
        expert = self._expert[index]
        if expert is None:
            return True
        held = expert in tier and tier.get(expert).gate_up.data_ptr() == self.slot(index).gate_up.data_ptr()
        if held:
            self._reserved.discard(index)  # the copy landed: the tier holds it now
            return False
        return index not in self._reserved


def slab_destination(tier, expert: int) -> ExpertWeights | None:
    """Where a copy of `expert` to `tier` should land: a free slot of the tier's slab, or None (allocate)."""
    slab = getattr(tier, "host_slab", None)  # set by the loader on tiers it gave a slab
    return None if slab is None else slab.take(expert, tier)


def copy_to_tier(weights: ExpertWeights, tier, expert: int) -> ExpertWeights:
    """A copy of `weights` for `tier` now: into a free slot of its slab, else new memory on its device."""
    out = slab_destination(tier, expert)
    if out is None:
        return weights.to(tier.device, pin=tier.pin)
    for dst, src in zip(out.tensors(), weights.tensors()):
        dst.copy_(src)
    return out
