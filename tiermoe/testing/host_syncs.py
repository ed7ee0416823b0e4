"""Would-be host synchronisations, counted on the CPU path: what a forward would make the host wait for on a GPU.

On a GPU the host queues work and runs ahead of the device; it stops and waits (a sync) when it needs something
the device has not produced yet. On the CPU path nothing ever waits, so `HostSyncCounter` flags the operations
that would, on the thread that enters it (torch's modes are per thread: a CPU tier's work on its worker thread is
host work and is not seen):
- output shapes that depend on values: nonzero (`torch.where(cond)`), unique, masked_select, boolean-mask
  indexing, repeat_interleave without output_size, bincount, torch.equal (aten ops, seen by a dispatch mode,
  before or after decomposition: inference mode leaves composite ops such as `where(cond)` whole);
- a device value read on the host: `.item()`, `bool()` / `int()` / `float()` of a tensor (aten
  `_local_scalar_dense`), `.tolist()`, `.numpy()`;
- copies device -> host (`.cpu()`, `.to("cpu")`, `copy_` into a host tensor) and blocking copies host -> device
  (`.to(device)` without non_blocking, `torch.tensor(data, device=...)`); a non_blocking host -> device copy is
  listed apart and not counted (from pinned memory the host does not wait for it).

Where a tensor would live. With the main device on the CPU, host and device are the same torch device, so a
transfer cannot be told from a no-op by device values. The counter tracks each tensor's side instead (a tag on
the tensor object, set by a function mode on every op's outputs):
- host side: what an explicit host transfer returns (to the string "cpu", `.cpu()`, to a device read from a
  host tensor or a CPU tier's `device`); what a CPU tier hands back (`sync`, `get`: host memory by its
  protocol); what a factory makes without a device; what an op makes from host-side inputs only;
- device side: everything else, including every tensor the counter did not see being made (parameters, KV
  caches, inputs): in doubt a tensor is on the device, so reading it counts.
A torch.device object read from a tensor has that tensor's side; `hybrid.gpu_device` and the GPU tiers' devices
name the device. Any other CPU torch.device object is ambiguous; it is read as whatever cannot hide a sync (a
factory's output goes to the device side, a copy to it crosses sides).
Counts go to the MoE layer whose block is running (forward hooks on `hybrid.blocks`), the rest to `OUTSIDE`.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST, DEVICE = "host", "device"
OUTSIDE = "outside MoE blocks"
_TAG = "_tiermoe_side"
_aten = torch.ops.aten

# The host must know the values before it can go on: the result's size, or a Python value.
_DATA_DEPENDENT = {
    _aten.nonzero, _aten.nonzero_numpy, _aten.argwhere, _aten._unique, _aten._unique2, _aten.unique_dim,
    _aten.unique_consecutive, _aten.unique_dim_consecutive, _aten.masked_select, _aten.bincount,
    _aten.equal, _aten.is_nonzero, _aten.allclose, _aten.item, _aten._local_scalar_dense,
}
_INDEXING = {_aten.index, _aten.index_put, _aten.index_put_}
_HOST_READS = {torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()"}
_TRANSFERS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
_DEVICE_GETTER = torch.Tensor.device.__get__


def side_of(t: torch.Tensor) -> str:
    return getattr(t, _TAG, DEVICE)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _mark(tensors, side: str) -> None:
    for t in tensors:
        try:
            setattr(t, _TAG, side)
        except (AttributeError, RuntimeError):  # a tensor type without attributes: it stays on the device side
            pass


def _non_blocking(rest, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", False)) or any(a is True for a in rest)


class _Sides(TorchFunctionMode):
    """Tags every op's outputs with their side; counts copies across sides and host reads of device values."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            dev = func(*args, **kwargs)
            self.counter._read_devices[id(dev)] = (dev, side_of(args[0]))  # holding dev keeps its id its own
            return dev
        if func in _HOST_READS and side_of(args[0]) == DEVICE:
            self.counter._flag(_HOST_READS[func])
        out = func(*args, **kwargs)
        produced = _tensors(out)
        if produced:
            side = self._output_side(func, args, kwargs)
            if out is args[0] and func in _TRANSFERS and side != side_of(out):
                out = produced[0] = out.view_as(out)  # a copy on a GPU; the source keeps its own side
            _mark(produced, side)
        return out

    def _output_side(self, func, args, kwargs) -> str:
        c = self.counter
        if func in _TRANSFERS:
            src = side_of(args[0])
            dst = c._copy_target(func, src, args, kwargs)
            c._copy(src, dst, _non_blocking(args[1:], kwargs), f".{func.__name__}()")
            return dst
        if func is torch.Tensor.copy_:
            c._copy(side_of(args[1]), side_of(args[0]), _non_blocking(args[2:], kwargs), ".copy_()")
            return side_of(args[0])
        inputs = _tensors((args, kwargs))
        if kwargs.get("device") is not None:
            side = c._device_side(kwargs["device"], if_ambiguous=DEVICE)
            if func in _FROM_DATA and side == DEVICE and not inputs:
                c._copy(HOST, DEVICE, False, f"torch.{func.__name__}(data, device=...)")
            return side
        if not inputs:
            return HOST  # a factory without a device makes host memory
        return DEVICE if any(side_of(t) == DEVICE for t in inputs) else HOST


class _Syncs(TorchDispatchMode):
    """Counts aten ops whose output shape (or Python result) depends on device values."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if any(side_of(t) == DEVICE for t in _tensors((args, kwargs))):
            if packet in _DATA_DEPENDENT:
                self.counter._flag(f"aten.{packet.__name__}")
            elif packet is _aten.where and len(args) == 1:  # torch.where(cond) = nonzero (so seen in inference mode)
                self.counter._flag("aten.where(cond)")
            elif packet in _INDEXING and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                             for i in args[1] or ()):
                self.counter._flag(f"aten.{packet.__name__} with a boolean mask")
            elif packet is _aten.repeat_interleave and kwargs.get("output_size") is None and \
                    (len(args) < 2 or isinstance(args[1], torch.Tensor)):
                self.counter._flag("aten.repeat_interleave without output_size")
        return func(*args, **kwargs)


class HostSyncCounter:
    """`with HostSyncCounter(hybrid) as c: hybrid(...)`, then `c.count(layer)`, `c.per_layer()`, `c.describe()`.

    `hybrid`: a loaded HybridModel (its blocks tell where a MoE layer starts and ends, its CPU tiers what is host
    memory), or None to count without layers (everything goes to OUTSIDE)."""

    def __init__(self, hybrid=None):
        self.hybrid = hybrid
        self.events: list[tuple[object, str]] = []  # (layer or OUTSIDE, what would sync)
        self.async_copies: list[tuple[object, str]] = []  # host -> device copies that need not wait
        self._read_devices: dict[int, tuple[torch.device, str]] = {}
        self._named_devices: list[tuple[torch.device, str]] = []
        self._layer: list[object] = [OUTSIDE]
        self._undo: list = []
        self._modes: list = []

    # -- what is counted
    def _flag(self, what: str) -> None:
        self.events.append((self._layer[-1], what))

    def _copy(self, src: str, dst: str, non_blocking: bool, how: str) -> None:
        if src == DEVICE and dst == HOST:
            self._flag(f"device-to-host copy {how}")
        elif src == HOST and dst == DEVICE:
            if non_blocking:
                self.async_copies.append((self._layer[-1], f"non_blocking host-to-device copy {how}"))
            else:
                self._flag(f"blocking host-to-device copy {how}")

    def _copy_target(self, func, src: str, args, kwargs) -> str:
        if func is torch.Tensor.cpu:
            return HOST
        if func is torch.Tensor.cuda:
            return DEVICE
        target = src  # .to(dtype) stays where it is
        for a in (*args[1:2], kwargs.get("device"), kwargs.get("other")):
            if isinstance(a, torch.Tensor):
                target = side_of(a)
            elif isinstance(a, (torch.device, str)) or (isinstance(a, int) and not isinstance(a, bool)):
                target = self._device_side(a, if_ambiguous=HOST if src == DEVICE else DEVICE)
        return target

    def _device_side(self, dev, if_ambiguous: str) -> str:
        if isinstance(dev, str):
            return HOST if torch.device(dev).type == "cpu" else DEVICE
        if isinstance(dev, int):
            return DEVICE  # a CUDA device index
        read = self._read_devices.get(id(dev))
        if read is not None and read[0] is dev:
            return read[1]
        if dev.type != "cpu":
            return DEVICE
        return next((side for named, side in self._named_devices if named is dev), if_ambiguous)

    # -- results
    def reset(self) -> None:
        self.events.clear()
        self.async_copies.clear()

    def count(self, layer) -> int:
        return sum(1 for at, _ in self.events if at == layer)

    def per_layer(self) -> dict[object, Counter]:
        out: dict[object, Counter] = defaultdict(Counter)
        for layer, what in self.events:
            out[layer][what] += 1
        return dict(out)

    def describe(self) -> str:
        lines = []
        for layer, kinds in sorted(self.per_layer().items(), key=lambda kv: (kv[0] == OUTSIDE, str(kv[0]))):
            name = layer if layer == OUTSIDE else f"MoE layer {layer}"
            lines.append(f"{name}: {sum(kinds.values())} = " + ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())))
        return "\n".join(lines) or "no would-be host syncs"

    # -- scope
    def __enter__(self) -> HostSyncCounter:
        if self.hybrid is not None:
            self._named_devices.append((self.hybrid.gpu_device, DEVICE))
            for layer, block in self.hybrid.blocks.items():
                self._undo.append(block.register_forward_pre_hook(
                    lambda m, a, layer=layer: self._layer.append(layer)).remove)
                self._undo.append(block.register_forward_hook(self._leave_layer).remove)
                self._named_devices += [(block.gpu_tier.device, DEVICE), (block.cpu_tier.device, HOST)]
                before = block.crosses_to_host  # make the copies a GPU needs, so they are counted
                block.crosses_to_host = True
                self._undo.append(lambda block=block, before=before: setattr(block, "crosses_to_host", before))
                self._hand_back_host_memory(block.cpu_tier)
        self._modes = [_Sides(self), _Syncs(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for undo in reversed(self._undo):
            undo()
        self._modes, self._undo = [], []
        self._read_devices.clear()

    def _leave_layer(self, module, args, output) -> None:
        self._layer.pop()  # and return None: a forward hook's non-None result would replace the block's output

    def _hand_back_host_memory(self, tier) -> None:
        """What a CPU tier hands back is host memory (its protocol says so), whichever thread made it."""
        for name in ("sync", "get"):
            before = tier.__dict__.get(name)
            original = getattr(tier, name)

            def tagged(*args, _original=original, **kwargs):
                out = _original(*args, **kwargs)
                _mark(out.tensors() if hasattr(out, "tensors") else _tensors(out), HOST)
                return out

            setattr(tier, name, tagged)
            self._undo.append(lambda tier=tier, name=name, before=before:
                              setattr(tier, name, before) if before is not None else delattr(tier, name))
