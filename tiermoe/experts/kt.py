"""kt-kernel (KTransformers' CPU MoE operators) as a CPU tier: `--cpu-backend kt`, optional (`tiermoe[kt]`).

kt-kernel takes a whole layer's experts at once, as contiguous gate [E, I, D], up [E, I, D] and down [E, D, I]
bf16 tensors, and quantises them itself when loading (AMXINT8: per channel; AMXINT4: per channel, no groups). So
this tier keeps each expert's canonical bf16 weights (what `get` returns), stacks them into those tensors, and
(re)builds kt's operator lazily at the first forward after experts were added or removed. Experts it does not
hold are marked as GPU experts for kt; the layer already sends their pairs as -1.

Install kt-kernel without its dependencies (its wheel pins a CUDA torch): `pip install --no-deps kt-kernel==0.7.2`
plus gguf typer rich pyyaml httpx packaging. kt's threads spin while waiting: on a 2-core machine 1 thread is
its best decode setting. Only SiLU-GLU experts (kt has no GPT-OSS clamp with biases here).
Legend: T tokens, D hidden, K top-k, I intermediate, E experts.
"""

from __future__ import annotations

import torch

from tiermoe.errors import TiermoeError
from tiermoe.experts.ffn import ExpertActivation
from tiermoe.experts.threads import pool_sizes
from tiermoe.experts.tiers import ComputedOnWorker, CPUWorker
from tiermoe.experts.weights import ExpertWeights

KT_CLASSES = {"bf16": ("AMXBF16_MOE", "AVX2BF16_MOE"), "int8": ("AMXInt8_MOE",), "int4": ("AMXInt4_MOE",)}
MAX_CHUNK = 1024  # tokens per kt call: kt sizes its buffers by max_len, longer inputs go in chunks


def kt_extension():
    """kt_kernel's compiled module, or a TiermoeError saying how to install it."""
    try:
        import kt_kernel
    except ImportError as e:
        raise TiermoeError("--cpu-backend kt needs kt-kernel: pip install --no-deps kt-kernel==0.7.2 "
                           "gguf typer rich pyyaml httpx packaging (or pip install 'tiermoe[kt]')") from e
    return kt_kernel.kt_kernel_ext


class KtInfer:
    """kt's worker pool (one per model, shared by every layer through the CPU worker)."""

    def __init__(self, threads: int, numa_nodes: tuple[int, ...] | None = None):
        ext = kt_extension()
        cfg = ext.WorkerPoolConfig()
        nodes = list(numa_nodes or (0,))  # one pool per --kt-numa-nodes entry, as SGLang-kt configures kt-kernel
        cfg.subpool_count = len(nodes)
        cfg.subpool_numa_map = nodes
        cfg.subpool_thread_count = pool_sizes(threads, len(nodes))
        self.cpu = ext.CPUInfer(cfg)

    def run(self, task) -> None:
        self.cpu.submit(task)
        self.cpu.sync()


class KtCPUExperts(ComputedOnWorker):
    """A CPU tier computed by kt-kernel in `fmt` ("bf16" | "int8" | "int4")."""

    def __init__(self, worker: CPUWorker, act: ExpertActivation, fmt: str, dtype: torch.dtype, threads: int,
                 pin: bool = False, layer: int = 0, numa_nodes: tuple[int, ...] | None = None):
        self.ext = kt_extension()
        if act.kind != "silu_glu":
            raise TiermoeError(f"--cpu-backend kt computes SiLU-GLU experts only, not {act.kind}; "
                               "use --cpu-backend native or torch for this model")
        if fmt not in KT_CLASSES:
            raise TiermoeError(f"kt-kernel has no {fmt} experts; choose --cpu-expert-dtype "
                               f"{' / '.join(KT_CLASSES)}, or --cpu-backend native")
        names = [n for n in KT_CLASSES[fmt] if getattr(self.ext.moe, n, None) is not None]
        if not names:
            raise TiermoeError(f"this kt-kernel build has no {fmt} MoE operator for this CPU")
        self.moe_class = getattr(self.ext.moe, names[0])
        self.device, self.pin = torch.device("cpu"), pin
        self.worker, self.fmt, self.dtype, self.threads, self.layer = worker, fmt, dtype, threads, layer
        self.numa_nodes = numa_nodes
        self._experts: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # bf16 gate, up, down
        self._moe = None  # (operator, top_k, the tensors it points into); None = rebuild before the next forward

    def __contains__(self, expert: int) -> bool:
        return expert in self._experts

    def __len__(self) -> int:
        return len(self._experts)

    @property
    def nbytes(self) -> int:
        """Bytes of the bf16 weights held here (for `get`) plus kt's own packed copy (estimated from the format:
        kt does not report it)."""
        params = sum(t.numel() for w in self._experts.values() for t in w)
        return int(params * (2 + {"bf16": 2, "int8": 1, "int4": 0.5}[self.fmt]))

    def add(self, expert: int, weights: ExpertWeights) -> None:
        if weights.gate_up_bias is not None or weights.down_bias is not None:
            raise TiermoeError("--cpu-backend kt cannot hold experts with biases")
        gate, up = weights.gate_up.to(torch.bfloat16).chunk(2)
        self._experts[expert] = (gate.contiguous(), up.contiguous(), weights.down.to(torch.bfloat16).contiguous())
        self._moe = None

    def get(self, expert: int) -> ExpertWeights:
        gate, up, down = self._experts[expert]
        return ExpertWeights(torch.cat([gate, up]).to(self.dtype), down.to(self.dtype))

    def pop(self, expert: int) -> ExpertWeights:
        w = self.get(expert)
        del self._experts[expert]
        self._moe = None
        return w

    def parked(self, expert: int) -> bool:
        return False  # bf16 is held (kt quantises its own copy at each build): a round trip gives it back exactly

    def _build(self, top_k: int):
        """Stack the held experts into kt's layout and load a new operator. int8 / int4: kt quantises its own
        copy at load, so the stacked bf16 is dropped afterwards; bf16: kt reads it, so the held experts become
        views into it (one copy, not two)."""
        n_exp = max(self._experts) + 1
        i, d = next(iter(self._experts.values()))[0].shape
        gate = torch.zeros(n_exp, i, d, dtype=torch.bfloat16)
        up = torch.zeros(n_exp, i, d, dtype=torch.bfloat16)
        down = torch.zeros(n_exp, d, i, dtype=torch.bfloat16)
        on_gpu = torch.ones(n_exp, dtype=torch.bool)  # kt skips "GPU" experts: every id this tier does not hold
        for e, (g, u, dn) in self._experts.items():
            gate[e], up[e], down[e] = g, u, dn
            on_gpu[e] = False
        cfg = self.ext.moe.MOEConfig(n_exp, top_k, d, i, on_gpu.data_ptr())
        infer = self.worker.shared(("tiermoe.kt.infer", self.threads, self.numa_nodes),
                                   lambda: KtInfer(self.threads, self.numa_nodes))
        cfg.pool = infer.cpu.backend_
        cfg.max_len = MAX_CHUNK
        cfg.layer_idx = self.layer
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        moe = self.moe_class(cfg)
        logical = torch.arange(n_exp, dtype=torch.int64)
        infer.run(moe.load_weights_task(logical.data_ptr()))
        keep = (on_gpu, logical, cfg)
        if self.fmt == "bf16":
            for e in self._experts:
                self._experts[e] = (gate[e], up[e], down[e])
            keep += (gate, up, down)
        return moe, top_k, infer, keep

    def _compute(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if self._moe is None or self._moe[1] != ids_TK.shape[1]:
            self._moe = self._build(ids_TK.shape[1])
        moe, _, infer, _ = self._moe
        x = x_TD.to(torch.bfloat16).contiguous()
        ids = ids_TK.to(torch.int64).contiguous()
        w = weights_TK.to(torch.float32).contiguous()
        y = torch.empty_like(x)
        for t0 in range(0, x.shape[0], MAX_CHUNK):
            t1 = min(t0 + MAX_CHUNK, x.shape[0])
            qlen = torch.tensor([t1 - t0], dtype=torch.int32)
            infer.run(moe.forward_task(qlen.data_ptr(), ids.shape[1], ids[t0].data_ptr(), w[t0].data_ptr(),
                                       x[t0].data_ptr(), y[t0].data_ptr(), False))
        return y.to(x_TD.dtype)
