"""Adapters served per request: several PEFT LoRA adapters loaded at once, unmerged, each chosen by name per request.

What SGLang and vLLM serve with `--lora-paths` / `--lora-modules`: every loaded adapter holds a slot (1 ... max;
0 is the base model), and a step's rows may each run with another adapter or none (tiermoe.layers.adapter_rows).
Loading one puts its factors beside the other slots' on each weight it adapts (tiermoe.layers.lora_stack):
- a linear (attention, dense and shared-expert projections; nn.Linear, a packed QuantizedLinear or an FP8Linear)
  becomes a RowLoRALinear around it, and is itself again once no loaded adapter adapts it;
- a router (softmax top-k, or DeepSeek's grouped routers) adds the rows' updates to its logits, before its top-k;
  a transformers router is first replaced by tiermoe's equivalent module, which has that hook;
- a MoE layer's routed experts, on either tier, get a RowExpertLoRA: the pairs of adapter rows are computed
  expert by expert with the tier's own products plus the LoRA products (tiermoe.layers.row_expert_lora).
The adapter is data here, read from its directory by tiermoe.training.adapter_merge.merged_lora (a MergedLoRA, the
same as `--lora DIR` merges), so this package needs no PEFT at serving time.

Not taken per request (a one-line TiermoeError; merge such an adapter with `--lora DIR`): LoRA on the LM head
(it runs on the sampled rows only), on MLA's kv_b_proj (its decode reads the weight itself), on a module that is
not a linear or one of those routers, on a model loaded for training, or with several ranks.

Changes happen between engine steps only (the engine thread, or a caller that runs no step meanwhile). Unloading
is two-phase: `retire` takes the name away at once (new requests cannot ask for it), and `free` gives the slot back
once no sequence runs with it (tiermoe.engine.engine frees retired adapters as their last sequence ends).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from tiermoe.checkpoint.fp8 import FP8Linear
from tiermoe.errors import TiermoeError
from tiermoe.layers.adapter_rows import AdapterRows
from tiermoe.layers.fused_decode_layer import FusedDecodeLayer
from tiermoe.layers.fused_grouped_router import FusedGroupedRouter, grouped
from tiermoe.layers.fused_router import ROUTER_FORMS, FusedTopKRouter
from tiermoe.layers.lora_stack import LoRAStack
from tiermoe.layers.mla_attention import MLAAttention
from tiermoe.layers.quantized_linear import QuantizedLinear
from tiermoe.layers.row_expert_lora import RowExpertLoRA
from tiermoe.layers.row_lora_linear import RowLoRALinear
from tiermoe.model.hybrid_experts import HybridEveryExpert
from tiermoe.model.hybrid_model import HybridModel
from tiermoe.model.lora_merge import MergedLoRA

DEFAULT_MAX_LOADED = 8  # SGLang's --max-loras-per-batch default
MAX_LOADED = 64  # each loaded adapter widens every stacked product it adapts: a bound on that cost
MAX_NAME_CHARS = 128
BASE_TAG = "latest"  # "<served name>:latest" names the base model (Ollama's tag): no adapter may be called so
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/@+-]*")
_LINEARS = (nn.Linear, QuantizedLinear, FP8Linear, RowLoRALinear)


def check_adapter_name(name: str) -> str:
    """`name` if it can name an adapter (a request asks for it by this name), else a one-line TiermoeError."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_CHARS or not _NAME.fullmatch(name):
        shown = repr(name)[:MAX_NAME_CHARS + 2]
        raise TiermoeError(f"adapter name {shown} is not usable; expected 1-{MAX_NAME_CHARS} letters, digits and "
                           "._/@+- (starting with a letter or digit)")
    if name == BASE_TAG:
        raise TiermoeError(f"an adapter cannot be called {BASE_TAG!r}: '<served name>:{BASE_TAG}' names the base "
                           "model")
    return name


@dataclass(eq=False)
class LoadedAdapter:
    """One adapter holding a slot. `salt` starts the prefix cache's page keys of its sequences, so KV computed
    with it is found again only by it (a name loaded again later gets a new salt)."""

    name: str
    slot: int
    path: str
    salt: bytes
    retired: bool = False  # unloading: no new request may ask for it; its slot is freed with its last sequence
    freed: bool = False  # its slot is given back (set on the engine's thread; an unload waits for it)
    stacks: list[LoRAStack] = field(default_factory=list, repr=False)  # what it put factors into


class ServedAdapters:
    """The adapters served per request on one model (single process, inference only)."""

    def __init__(self, hybrid: HybridModel, max_loaded: int = DEFAULT_MAX_LOADED):
        if hybrid.trainable:
            raise TiermoeError("adapters served per request need a model loaded for inference (trainable=False)")
        if hybrid.share is not None:
            raise TiermoeError("adapters served per request run in one process; several ranks do not take them yet")
        if not 1 <= max_loaded <= MAX_LOADED:
            raise TiermoeError(f"max_loaded must be 1-{MAX_LOADED} adapters, got {max_loaded}")
        self.hybrid = hybrid
        self.max_loaded = max_loaded
        self.rows = AdapterRows(hybrid.gpu_device)
        # the factors' dtype: a bf16 model's (as SGLang and vLLM hold adapters), else fp32 (tiermoe.layers.lora_stack)
        self.factor_dtype = torch.bfloat16 if hybrid.model.dtype == torch.bfloat16 else torch.float32
        self.by_name: dict[str, LoadedAdapter] = {}  # the adapters requests may ask for
        self.held: list[LoadedAdapter] = []  # every adapter holding a slot (retired ones until freed)
        self.names: frozenset[str] = frozenset()  # by_name's keys, replaced whole on change (read from any thread)
        self._loads = itertools.count(1)
        for module in hybrid.model.modules():  # fused whole-layer calls leave a step with adapter rows to the modules
            if isinstance(module, FusedDecodeLayer):
                module.adapter_rows = self.rows

    def get(self, name: str) -> LoadedAdapter:
        """The adapter a request names; a TiermoeError naming it and listing the loaded ones when it is not."""
        found = self.by_name.get(name)
        if found is None:
            loaded = f"loaded: {', '.join(sorted(self.by_name))}" if self.by_name else "none is loaded"
            raise TiermoeError(f"there is no LoRA adapter {str(name)[:80]!r} on this server ({loaded})")
        return found

    def paths(self) -> dict[str, str]:
        """{name: the directory it was read from} of the adapters requests may ask for."""
        return {name: a.path for name, a in self.by_name.items()}

    def load(self, name: str, lora: MergedLoRA, path: str = "") -> LoadedAdapter:
        """Serve `lora` under `name` from the next step on. Everything is checked before anything changes."""
        check_adapter_name(name)
        if name in self.by_name:
            raise TiermoeError(f"an adapter named {name!r} is loaded already; unload it first, or use another name")
        if len(self.held) >= self.max_loaded:
            unloading = sum(a.retired for a in self.held)
            waiting = f" ({unloading} of them unloading, waiting for their requests)" if unloading else ""
            raise TiermoeError(f"{len(self.held)} adapters are loaded{waiting}, the most this server holds "
                               f"(--max-loras-per-batch {self.max_loaded}); unload one first")
        targets = [(self._weight_target(weight, lora.source), delta) for weight, delta in lora.weights.items()]
        expert_layers = self._expert_layers(lora)
        if not targets and not expert_layers:
            raise TiermoeError(f"{lora.source} adapts nothing in this model")
        slot = min(set(range(1, self.max_loaded + 1)) - {a.slot for a in self.held})
        adapter = LoadedAdapter(name, slot, path, f"adapter {next(self._loads)}".encode())
        try:
            for (module_name, module), delta in targets:
                self._put(adapter, self._stack_of(module_name, module), delta)
            for layer, deltas in expert_layers.items():
                block = self.hybrid.blocks[layer]
                if block.row_lora is None:
                    block.row_lora = RowExpertLoRA(self.rows, layer, self.hybrid.gpu_device, self.factor_dtype)
                for projection, delta in deltas.items():
                    self._put(adapter, block.row_lora.stacks[projection], delta)
        except (ValueError, RuntimeError) as err:  # shapes that do not stack (out of memory): nothing stays
            self.held.append(adapter)
            self.free(adapter)
            raise TiermoeError(f"{lora.source} could not be loaded: {err}") from None
        self.rows.forget_layouts()
        self.held.append(adapter)
        self.by_name[name] = adapter
        self.names = frozenset(self.by_name)
        return adapter

    def retire(self, name: str) -> LoadedAdapter:
        """Take `name` away from requests now (TiermoeError when it is not loaded); `free` gives its slot back."""
        adapter = self.get(name)
        adapter.retired = True
        del self.by_name[name]
        self.names = frozenset(self.by_name)
        return adapter

    def free(self, adapter: LoadedAdapter) -> None:
        """Give a retired adapter's slot back: its factors leave every weight (no sequence may run with it)."""
        if adapter not in self.held:
            return
        for stack in adapter.stacks:
            stack.drop(adapter.slot)
        self.held.remove(adapter)
        self.rows.forget_layouts()
        self._unwrap_empty()
        adapter.freed = True

    # -- where each weight's factors go -----------------------------------------------------------------------

    @staticmethod
    def _put(adapter: LoadedAdapter, stack: LoRAStack, delta) -> None:
        stack.put(adapter.slot, delta.A, delta.B, delta.scaling)
        adapter.stacks.append(stack)

    def _weight_target(self, weight: str, source: str) -> tuple[str, nn.Module]:
        """(module name, module) of the adapted parameter `weight` (e.g. "model.layers.0.self_attn.q_proj.weight"),
        checked to be one per-row LoRA can adapt."""
        module_name, _, param = weight.rpartition(".")
        model = self.hybrid.model
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            module = None
        refuse = f"{source} adapts '{weight}'"
        merge = "; serve it merged into the weights instead (--lora DIR)"
        if module is None or param != "weight":
            raise TiermoeError(f"{refuse}, which this model does not have as a module's weight{merge}")
        if module is model.get_output_embeddings():
            raise TiermoeError(f"{refuse}: LoRA on the LM head is not served per request (it runs on the sampled rows "
                               f"only){merge}")
        parent = model.get_submodule(module_name.rpartition(".")[0]) if "." in module_name else model
        if isinstance(parent, MLAAttention) and module_name.endswith("kv_b_proj"):
            raise TiermoeError(f"{refuse}: MLA's kv_b_proj is read as a weight by its decode, not called per row"
                               f"{merge}")
        if not (isinstance(module, _LINEARS) or _router_kind(module) is not None):
            raise TiermoeError(f"{refuse}, a {type(module).__name__}: per request tiermoe adapts linears, routers and "
                               f"routed experts{merge}")
        return module_name, module

    def _stack_of(self, module_name: str, module: nn.Module) -> LoRAStack:
        """The LoRAStack of a checked target, made (and the module wrapped or replaced) on first use."""
        if isinstance(module, RowLoRALinear):
            return module.lora
        kind = _router_kind(module)
        if kind is None:
            wrapper = RowLoRALinear(module, LoRAStack(self.rows, module_name, self.hybrid.gpu_device, self.factor_dtype))
            self._replace(module_name, wrapper)
            return wrapper.lora
        if kind == "transformers":
            module = (FusedGroupedRouter if grouped(module) else FusedTopKRouter)(module, None)
            self._replace(module_name, module)
        if module.lora is None:
            module.lora = LoRAStack(self.rows, module_name, self.hybrid.gpu_device, self.factor_dtype)
        return module.lora

    def _expert_layers(self, lora: MergedLoRA) -> dict[int, dict]:
        for layer in lora.experts:
            if layer not in self.hybrid.blocks:
                raise TiermoeError(f"{lora.source} has LoRA on the routed experts of layer {layer}, which is not a MoE "
                                   "layer of this model")
            if isinstance(self.hybrid.blocks[layer], HybridEveryExpert):  # its rows are copies, not the step's
                raise TiermoeError(f"{lora.source} has LoRA on the routed experts of layer {layer}, whose experts "
                                   "module takes every expert's copy of every token: not served per request; serve "
                                   "it merged into the weights instead (--lora DIR)")
        return {layer: deltas for layer, deltas in lora.experts.items() if deltas}

    def _replace(self, module_name: str, module: nn.Module) -> None:
        parent, _, leaf = module_name.rpartition(".")
        setattr(self.hybrid.model.get_submodule(parent) if parent else self.hybrid.model, leaf, module)

    def _unwrap_empty(self) -> None:
        """Linears no loaded adapter adapts any more are themselves again; empty expert LoRA goes."""
        for name, module in list(self.hybrid.model.named_modules()):
            if isinstance(module, RowLoRALinear) and module.lora.empty:
                self._replace(name, module.base_layer)
        for block in self.hybrid.blocks.values():
            if block.row_lora is not None and block.row_lora.empty:
                block.row_lora = None


def _router_kind(module: nn.Module) -> str | None:
    """"tiermoe" for a router with the per-row hook, "transformers" for one it can replace, else None."""
    if isinstance(module, (FusedTopKRouter, FusedGroupedRouter)):
        return "tiermoe"
    if ROUTER_FORMS.of(type(module)) is not None or grouped(module):
        return "transformers"
    return None

