"""The native CPU tier: experts stored bf16 / int8 / int4 / int6, a whole layer computed by one C++ call.

Each expert is quantised once when added (tiermoe.experts.quant) and packed for the kernels; `submit` hands the
layer's tokens to the model's CPU-worker thread, which makes one call into the kernel library: route, gather,
gate_up + activation, down and the weighted sum, on a pinned thread team that synchronises three times per layer.
The kernels compute SiLU-GLU and GPT-OSS's clamped SwiGLU (gate = min(gate, limit), up = clamp(up, -limit, limit),
(up + 1) * gate * sigmoid(alpha * gate)), each with or without per-expert biases (GPT-OSS's gate_up and down
biases, added after each product as transformers adds them). The biases are held twice: as given (what `get` and
the training products return) and as fp32 in the kernels' packed row order (about 0.1% of an expert's bytes).

Falls back to pure torch (the same stored formats, dequantised per routed expert) when
  - the kernels are unavailable (no compiler, not x86-64, TIERMOE_CPU_ISA=torch, or `isa="torch"`), or
  - the activation is one the kernels lack (a module's own, "model"): that layer keeps the exact torch path.
bf16 experts whose shapes are not multiples of 32 also stay in the checkpoint's row layout on the torch path, so
no padding is ever held for them. Legend: T tokens, D hidden, K top-k, I intermediate, E experts.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from tiermoe.config import CPUConfig
from tiermoe.experts.ffn import ConvertedOnLookup, ExpertActivation, routed_experts_forward
from tiermoe.experts.kernel_matmuls import KernelMatmuls, c_matrix
from tiermoe.experts.kernels import (
    ACTIVATION_CODES,
    Kernels,
    ThreadTeam,
    TmLayerArgs,
    TmLoraArgs,
    TmMatrix,
    load_kernels,
)
from tiermoe.experts.quant import (
    GROUPED,
    QMatrix,
    dequantize,
    expert_in_layout,
    k_align,
    kernels_take_shape,
    quantize,
    round_up,
)
from tiermoe.experts.threads import default_threads, numa_team_cpus, team_cpus
from tiermoe.experts.tiers import ComputedOnWorker, CPUWorker
from tiermoe.experts.weights import ExpertWeights

# Experts with at least this many routed tokens use AMX tiles; fewer use the vector kernels (one 16-row tile
# would be mostly padding, and a few tokens are memory-bound either way).
AMX_MIN_ROWS = 4


class _Stored:
    """One expert as held: gate_up [2I, D] and down [D, I] as QMatrix, biases as given, and (blocked layout only)
    the biases as the kernels read them: `kernel_biases` (gate_up [2Ip] fp32, gate rows then up rows each padded to
    Ip with zeros, as the packed rows; down [D] fp32), each None where the expert has no such bias."""

    def __init__(self, gate_up: QMatrix, down: QMatrix, gate_up_bias, down_bias, kernel_biases=(None, None)):
        self.gate_up, self.down = gate_up, down
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        self.kernel_biases = kernel_biases

    def tensors(self) -> list[torch.Tensor]:
        biases = [t for t in (self.gate_up_bias, self.down_bias, *self.kernel_biases) if t is not None]
        return [*self.gate_up.tensors(), *self.down.tensors(), *biases]

    def dequantized(self, dtype: torch.dtype) -> ExpertWeights:
        """The canonical expert in `dtype` (biases cast too)."""
        return ExpertWeights(dequantize(self.gate_up, dtype), dequantize(self.down, dtype),
                             _cast(self.gate_up_bias, dtype), _cast(self.down_bias, dtype))


class NativeCPUExperts(ComputedOnWorker):
    """A CPU tier in `fmt` ("bf16" | "int8" | "int4" | "int6"), the experts' down projections in `down_fmt` (None:
    `fmt`; an int4 model's are int6 by default, tiermoe.config.CPUConfig.down_format); `dtype` is the model's dtype
    (what `get` returns).

    threads: members of the kernel thread team (the worker thread plus threads - 1 helpers), shared by all layers
    of the model through the worker; numa_nodes: pin them as kt-kernel's per-node pools (tiermoe.experts.threads).
    isa: force a kernel level ("amx" ... "base") or "torch"; None = best.
    """

    def __init__(self, worker: CPUWorker, act: ExpertActivation, fmt: str, dtype: torch.dtype, threads: int,
                 pin: bool = False, isa: str | None = None, amx_min_rows: int = AMX_MIN_ROWS,
                 numa_nodes: tuple[int, ...] | None = None, down_fmt: str | None = None):
        down_fmt = down_fmt or fmt
        if k_align(down_fmt) != k_align(fmt):  # the layer's padded I is shared by gate_up's rows and down's columns
            raise ValueError(f"experts' down projections in {down_fmt} cannot sit beside gate_up in {fmt}; "
                             f"choose int4 with int6 (or one format for both)")
        self.device = torch.device("cpu")
        self.numa_nodes = numa_nodes
        self.pin = pin
        self.worker, self.act, self.fmt, self.down_fmt, self.dtype = worker, act, fmt, down_fmt, dtype
        self.threads, self.amx_min_rows = threads, amx_min_rows
        self.kernels = load_kernels(isa) if act.kind in ACTIVATION_CODES else None
        self._experts: dict[int, _Stored] = {}
        # Promoted experts' stored forms, kept (int4 / int6 only) so a demotion restores the exact codes: int4 quantised
        # again from its own dequantised copy is not the same (about 10% of the codes move, and the expert drifts
        # further with every round trip), whereas int8 per row and bf16 come back exactly. Bounded by the GPU
        # tier's experts at about a quarter of their bf16 bytes.
        self._parked: dict[int, _Stored] = {}
        self._shape: tuple[int, int] | None = None  # (D, I)
        self._blocked = False  # decided by the first expert's shape
        # ctypes arrays indexed by expert id: TmMatrix (gate_up, down), then bias pointers (gate_up, down)
        self._tables: tuple | None = None
        self._layer_args: TmLayerArgs | None = None  # `layer_args`, made again when the tables are

    # -- holding experts -------------------------------------------------------------------------------------

    def __contains__(self, expert: int) -> bool:
        return expert in self._experts

    def __len__(self) -> int:
        return len(self._experts)

    @property
    def experts(self) -> list[int]:
        return sorted(self._experts)

    @property
    def nbytes(self) -> int:
        held = [*self._experts.values(), *self._parked.values()]
        return sum(t.numel() * t.element_size() for s in held for t in s.tensors())

    @property
    def path(self) -> str:
        """Which code computes this tier: "kernels/<isa>" or "torch"."""
        return f"kernels/{self.kernels.isa_name}" if self._blocked else "torch"

    def add(self, expert: int, weights: ExpertWeights) -> None:
        if weights.device.type != "cpu":
            raise ValueError(f"expert {expert} is on {weights.device}, this tier is cpu")
        self.add_quantized(expert, quantize(weights.gate_up, self.fmt), quantize(weights.down, self.down_fmt),
                           weights.gate_up_bias, weights.down_bias)

    def _adopt_shape(self, expert: int, d: int, i: int) -> None:
        """The first expert fixes the layer's (D, I) and whether the kernels compute it; later ones must match."""
        if self._shape is None:
            self._shape = (d, i)
            self._blocked = (self.kernels is not None and kernels_take_shape(self.fmt, d, i)
                             and kernels_take_shape(self.down_fmt, d, i))
        elif self._shape != (d, i):
            raise ValueError(f"expert {expert} has shape D={d}, I={i}; this layer's experts have D, I = {self._shape}")

    def add_quantized(self, expert: int, gate_up: QMatrix, down: QMatrix, gate_up_bias=None,
                      down_bias=None) -> None:
        """An expert already in this tier's format (just quantised by `add`, or memory-mapped from a `tiermoe
        convert` cache): held as given when its layout is the one this tier computes with, re-laid-out otherwise,
        never quantised again."""
        if gate_up.fmt != self.fmt or down.fmt != self.down_fmt:
            raise ValueError(f"expert {expert} is stored as {gate_up.fmt} (down {down.fmt}), this tier holds "
                             f"{self.fmt} (down {self.down_fmt})")
        d, i = down.n, down.k
        self._adopt_shape(expert, d, i)
        wrong_gate_up = gate_up_bias is not None and tuple(gate_up_bias.shape) != (2 * i,)
        if wrong_gate_up or (down_bias is not None and tuple(down_bias.shape) != (d,)):
            raise ValueError(f"expert {expert}'s biases have shapes {_shape(gate_up_bias)}, {_shape(down_bias)}; "
                             f"expected gate_up [{2 * i}] and down [{d}]")
        gate_up, down = expert_in_layout(gate_up, down, "blocked" if self._blocked else "rows")
        kernel_biases = self._kernel_biases(gate_up_bias, down_bias) if self._blocked else (None, None)
        self._parked.pop(expert, None)  # what is added now replaces a kept form
        self._experts[expert] = _Stored(gate_up, down, gate_up_bias, down_bias, kernel_biases)
        self._set_table(expert)

    def _kernel_biases(self, gate_up_bias: torch.Tensor | None,
                       down_bias: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """An expert's biases as the kernels read them (see _Stored)."""
        _, i = self._shape
        gate_up = None
        if gate_up_bias is not None:
            ip = round_up(i, k_align(self.fmt))
            gate_up = torch.zeros(2 * ip, dtype=torch.float32)
            gate_up[:i], gate_up[ip: ip + i] = gate_up_bias[:i], gate_up_bias[i:]
        return gate_up, None if down_bias is None else down_bias.to(torch.float32).contiguous()

    def get(self, expert: int) -> ExpertWeights:
        """The expert in the canonical layout and the model's dtype (dequantised; pinned when `pin`)."""
        weights = self._experts[expert].dequantized(self.dtype)
        return weights.to("cpu", pin=True) if self.pin else weights

    def pop(self, expert: int) -> ExpertWeights:
        weights = self.get(expert)
        stored = self._experts.pop(expert)
        if self.fmt in GROUPED or self.down_fmt in GROUPED:  # see _parked
            self._parked[expert] = stored
        self._set_table(expert)
        return weights

    def parked(self, expert: int) -> bool:
        return expert in self._parked

    def restore(self, expert: int) -> None:
        self._experts[expert] = self._parked.pop(expert)
        self._set_table(expert)

    def _set_table(self, expert: int) -> None:
        """Point the kernels' per-expert table entry at the stored tensors (or clear it)."""
        if not self._blocked:
            return
        if self._tables is None or expert >= len(self._tables[0]):
            size = max(expert + 1, 2 * len(self._tables[0]) if self._tables else 0)
            new = ((TmMatrix * size)(), (TmMatrix * size)(), (ctypes.c_void_p * size)(), (ctypes.c_void_p * size)())
            if self._tables is not None:
                for old, fresh in zip(self._tables, new, strict=True):
                    ctypes.memmove(fresh, old, ctypes.sizeof(old))
            self._tables = new
            self._layer_args = None
        s = self._experts.get(expert)
        for table, m in zip(self._tables[:2], (s.gate_up, s.down) if s else (None, None), strict=True):
            table[expert] = c_matrix(m)
        for table, bias in zip(self._tables[2:], s.kernel_biases if s else (None, None), strict=True):
            table[expert] = None if bias is None else bias.data_ptr()

    # -- computing --------------------------------------------------------------------------------------------

    def matmuls(self, expert: int, dtype: torch.dtype) -> KernelMatmuls | None:
        """The expert's four products (tiermoe.experts.expert_matmuls) on the packed kernels, for activations of
        `dtype`; None when this tier computes with torch (tiermoe.experts.expert_matmuls.matmuls_of then multiplies
        the dequantised `get(expert)`). KeyError for an expert this tier does not hold."""
        stored = self._experts[expert]
        if not self._blocked:
            return None
        return KernelMatmuls(self.kernels, self._team, stored.gate_up, stored.down, stored.gate_up_bias,
                             stored.down_bias, dtype, self.amx_min_rows)

    def _compute(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        with torch.inference_mode():
            if self._blocked and x_TD.shape[0] > 0:
                return self._kernel_forward(x_TD, ids_TK, weights_TK, out)
            return self._torch_forward(x_TD, ids_TK, weights_TK)

    def _team(self) -> ThreadTeam:
        return kernel_team(self.worker, self.kernels, self.threads, self.numa_nodes)

    def thread_team(self) -> ThreadTeam:
        """The model's kernel thread team this tier computes on."""
        return self._team()

    def layer_args(self) -> TmLayerArgs | None:
        """What the kernels need of this layer's experts (TmLayerArgs less the call's T, x, y, ids and weights), for
        a caller that computes the layer inside a larger native call (tiermoe.layers.fused_decode_layer); None when
        this tier computes with torch. Valid until an expert is added beyond its tables' size (then made again)."""
        if not self._blocked or self._tables is None:
            return None
        if self._layer_args is None:
            self._layer_args = self._args()
        return self._layer_args

    def _args(self, **call) -> TmLayerArgs:
        """TmLayerArgs of this layer's experts and activation, with the fields of one call (`call`) filled."""
        (d, i), (gate_up, down, gate_up_bias, down_bias) = self._shape, self._tables
        return TmLayerArgs(isa=self.kernels.isa, amx_min_rows=self.amx_min_rows, D=d, I=i,
                           Dp=round_up(d, k_align(self.fmt)), Ip=round_up(i, k_align(self.fmt)),
                           n_experts=len(gate_up), gate_up=gate_up, down=down, act=ACTIVATION_CODES[self.act.kind],
                           alpha=self.act.alpha, limit=self.act.limit, gate_up_bias=gate_up_bias,
                           down_bias=down_bias, **call)

    def _kernel_forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        x = x_TD.contiguous() if x_TD.dtype in (torch.bfloat16, torch.float32) else x_TD.float()
        ids = ids_TK.to(torch.int64).contiguous()
        w = weights_TK.to(torch.float32).contiguous()
        # the kernels write the result where it is to go (a page-locked ring buffer) when its layout is theirs
        fits = out is not None and out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        y = out if fits else torch.empty_like(x)
        t, k = ids.shape
        args = self._args(T=t, K=k, x_bf16=int(x.dtype == torch.bfloat16), x=x.data_ptr(), y=y.data_ptr(),
                          ids=ids.data_ptr(), weights=w.data_ptr())
        err = ctypes.create_string_buffer(256)
        if self.kernels.lib.tm_moe_forward(self._team().handle, ctypes.byref(args), err, len(err)) != 0:
            raise RuntimeError(err.value.decode())
        return y.to(x_TD.dtype)

    def lora_forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                     lora: TmLoraArgs) -> torch.Tensor | None:
        """The layer's pairs of ids_TK (ids -1: another tier's or another path's) each with its token's LoRA update
        (csrc/tm_api.h TmLoraArgs: adapters served per request), in one call on this thread; None when this tier
        computes with torch (the caller computes expert by expert then)."""
        if not self._blocked or self._tables is None or x_TD.shape[0] == 0:
            return None
        x = x_TD.contiguous() if x_TD.dtype in (torch.bfloat16, torch.float32) else x_TD.float()
        ids = ids_TK.to(torch.int64).contiguous()
        w = weights_TK.to(torch.float32).contiguous()
        y = torch.empty_like(x)
        t, k = ids.shape
        args = self._args(T=t, K=k, x_bf16=int(x.dtype == torch.bfloat16), x=x.data_ptr(), y=y.data_ptr(),
                          ids=ids.data_ptr(), weights=w.data_ptr())
        err = ctypes.create_string_buffer(256)
        if self.kernels.lib.tm_moe_lora_forward(self._team().handle, ctypes.byref(args), ctypes.byref(lora), err,
                                                len(err)) != 0:
            raise RuntimeError(err.value.decode())
        return y.to(x_TD.dtype)

    def _torch_forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """The reference computation on dequantised weights (accumulated in x's dtype, as transformers does)."""
        experts = ConvertedOnLookup(self._experts, lambda s: s.dequantized(x_TD.dtype))  # one expert at a time
        return routed_experts_forward(experts, x_TD, ids_TK, weights_TK, self.act)


def kernel_team(worker: CPUWorker, kernels: Kernels, threads: int,
                numa_nodes: tuple[int, ...] | None = None) -> ThreadTeam:
    """The model's kernel thread team of `threads` members (made on first request, owned by the worker): every
    layer's CPU tier and the quantised non-expert linears (tiermoe.layers.quantized_linear) compute on it, the
    team's own lock ordering their calls."""
    cpus = (lambda: numa_team_cpus(threads, numa_nodes)) if numa_nodes else (lambda: team_cpus(threads))
    return worker.shared(("tiermoe.native.team", threads, numa_nodes), lambda: ThreadTeam(kernels, threads, cpus()))


def model_team(worker: CPUWorker, kernels: Kernels, cpu: CPUConfig) -> Callable[[], ThreadTeam]:
    """A getter of the model's kernel thread team with `cpu`'s threads (the team is made on the first call)."""
    threads = cpu.threads or default_threads()
    return lambda: kernel_team(worker, kernels, threads, cpu.numa_nodes)


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _shape(t: torch.Tensor | None) -> str:
    return "none" if t is None else str(list(t.shape))
