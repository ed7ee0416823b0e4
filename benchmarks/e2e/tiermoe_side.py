"""tiermoe's side of bench_e2e_cpu.py, run inside an e2e/worker.py process: one model loaded CPU-only (every expert
on the CPU tier, the default without a GPU), timed through the engine the way a user's request runs.

It may run against another commit's tiermoe (--compare-commit puts that tree first on PYTHONPATH), so it uses
only the long-standing API: LLM, its engine's add / step, SamplingParams, CPUConfig, HybridModel.blocks.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from bench_non_expert_quant import (  # benchmarks/, on sys.path by e2e/worker.py
    bytes_per_token,
    held_out_loss,
)

from tiermoe import LLM
from tiermoe.config import CPUConfig
from tiermoe.data.prompts import select
from tiermoe.data.registry import load_prompts
from tiermoe.engine.sampling import SamplingParams
from tiermoe.experts.kernels import load_kernels
from tiermoe.placement.kv_layout import kv_layout
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.per_pass_recorder import PerPassRecorder
from tiermoe.testing.op_counter import OpCounter

PROBE_BYTES = 1 << 30
# The kernel library's compute entries (products, attention, whole layers, norms, routing, rotary): the time a
# step spends inside them is measured by wrapping each (`native_time`); the rest of the step is Python, torch and
# the engine.
NATIVE_CALLS = ("tm_linear_forward", "tm_linear_transposed", "tm_moe_forward", "tm_moe_lora_forward",
                "tm_paged_decode_attention", "tm_decode_layer", "tm_rms_norm", "tm_rms_norm_gated", "tm_softmax_topk",
                "tm_grouped_topk", "tm_rotary_inplace", "tm_gated_delta_decode")


@contextmanager
def native_time(total: list[float]):
    """Adds the seconds spent inside the kernel library's compute entries to total[0] while active (every call
    goes through `kernels.lib.<name>`, looked up at the call, so wrapping the library's attributes catches all)."""
    kernels = load_kernels()
    lib = kernels.lib if kernels is not None else None
    wrapped = {name: getattr(lib, name) for name in NATIVE_CALLS if lib is not None and hasattr(lib, name)}

    def timed(fn):
        def call(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                total[0] += time.perf_counter() - start
        return call

    for name, fn in wrapped.items():
        setattr(lib, name, timed(fn))
    try:
        yield
    finally:
        for name, fn in wrapped.items():
            setattr(lib, name, fn)


class TiermoeSide:
    def __init__(self, path: str, threads: int | None, quant: str):
        """threads None: tiermoe's defaults (CPU tier and torch), as a user runs it without --cpu-threads."""
        if threads is not None:
            torch.set_num_threads(threads)  # the non-expert ops: the same cores as the CPU tier's threads
        cpu = CPUConfig(threads=threads)
        if quant == "4-bit":
            cpu = CPUConfig(threads=threads, expert_dtype="int4", non_expert_dtype="int4")
        self.llm = LLM(path, progress=False, cpu=cpu)
        self.engine = self.llm.engine
        self.layers = self.llm.hybrid.spec.num_layers

    def _start(self, prompt: list[int], tokens: int):
        seq = self.engine.add(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        self._step()  # the prompt, and the first token
        return seq

    def _step(self) -> None:
        for seq in self.engine.step():
            if seq.finish_reason == "error":
                raise RuntimeError(f"tiermoe failed a step: {getattr(seq, 'error', '?')}")

    def _finish(self) -> None:
        while self.engine.has_work():
            self._step()

    def first_token_s(self, prompt: list[int]) -> float:
        """Seconds from a request to its first token (prefill and one sampled token)."""
        start = time.perf_counter()
        self._start(prompt, 1)
        elapsed = time.perf_counter() - start
        self._finish()
        return elapsed

    def decode_s_per_token(self, prompt: list[int], tokens: int) -> float:
        """Seconds per decode step of one sequence, the prompt's step left out."""
        self._start(prompt, tokens + 1)
        start = time.perf_counter()
        self._finish()
        return (time.perf_counter() - start) / tokens

    def components_ms(self, prompt: list[int], steps: int) -> dict[str, float]:
        """ms per decode step in the LM head, the attention modules, the MoE blocks (router and experts) and the
        decoder layers computed whole by one native call (tiermoe.layers.fused_decode_layer: their attention and
        experts together, less any module timed inside them), timed by forward hooks; "rest" is the step less
        those: norms, embedding, residuals, the engine and sampling. "native" is the time inside the kernel
        library's calls (measured, `native_time`) and "outside_native" the step less it: what the step costs beyond
        the kernels (Python, torch's own ops, the engine), per step."""
        model = self.llm.hybrid.model
        parts = {"lm_head": [model.get_output_embeddings()],
                 "attention": [m for n, m in model.named_modules() if n.endswith(("self_attn", "linear_attn"))],
                 "experts": list(self.llm.hybrid.blocks.values()),
                 # by name: an older tree (--compare-commit) has no such class
                 "fused_layers": [m for m in model.modules() if type(m).__name__ == "FusedDecodeLayer"]}
        inner = ("lm_head", "attention", "experts")
        totals, started, hooks = dict.fromkeys(parts, 0.0), {}, []

        def enter(module, *_):
            started[id(module)] = (time.perf_counter(), sum(totals[p] for p in inner))

        def leave_into(part):
            def leave(module, *_):
                t0, inside = started[id(module)]
                nested = sum(totals[p] for p in inner) - inside if part == "fused_layers" else 0.0
                totals[part] += time.perf_counter() - t0 - nested
            return leave

        for part, modules in parts.items():
            for m in modules:
                hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave_into(part))]
        try:
            self._start(prompt, steps + 2)
            self._step()  # one decode step before timing
            totals.update(dict.fromkeys(parts, 0.0))
            native = [0.0]
            with native_time(native):
                start = time.perf_counter()
                for _ in range(steps):
                    self._step()
                step = (time.perf_counter() - start) / steps
            self._finish()
        finally:
            for h in hooks:
                h.remove()
        out = {part: totals[part] / steps * 1e3 for part in parts}
        out["step"] = step * 1e3
        out["rest"] = out["step"] - sum(out[p] for p in parts)
        out["native"] = native[0] / steps * 1e3
        out["outside_native"] = out["step"] - out["native"]
        return out

    def ops_per_layer(self, prompt: list[int]) -> float:
        """torch ops (aten and custom, on this thread) of one decode step, per decoder layer."""
        self._start(prompt, 3)
        counter = OpCounter()
        with counter:
            self._step()
        self._finish()
        return counter.ops / self.layers

    def bytes_per_token(self, context: float) -> int:
        """Weight bytes one decode token reads (bench_non_expert_quant.bytes_per_token) plus the KV cache of
        `context` tokens in the model's dtype."""
        return int(bytes_per_token(self.llm)[1] + self._kv_bytes(context))

    def _kv_bytes(self, context: float) -> float:
        """The KV cache of `context` tokens of one sequence, in the model's dtype."""
        hybrid = self.llm.hybrid
        text = getattr(hybrid.config, "text_config", None) or hybrid.config
        itemsize = hybrid.model.get_input_embeddings().weight.element_size()
        return context * kv_layout(text, itemsize).full_per_token

    def batched_decode(self, prompts: list[list[int]], tokens: int) -> dict:
        """len(prompts) sequences decoding together: seconds per step (their prompts' steps left out), and what
        one step reads at least, each weight once: the non-expert weights and head, per MoE layer the union of the
        experts the step's rows route to (counted by the per-pass recorder over `tokens` more steps, after the timed
        ones, so the timing pays no recording), and each sequence's KV cache."""
        seqs = [self.engine.add(p, SamplingParams(max_tokens=2 * tokens + 2, ignore_eos=True)) for p in prompts]
        while not all(s.output_ids for s in seqs):  # every prompt computed, every sequence decoding
            self._step()
        start = time.perf_counter()
        for _ in range(tokens):
            self._step()
        step_s = (time.perf_counter() - start) / tokens
        spec = self.llm.hybrid.spec
        per_pass = PerPassRecorder(ModelShape.of(spec))
        self.engine.add_recorder(per_pass)
        try:
            for _ in range(tokens):
                self._step()
        finally:
            per_pass.stop()
        self._finish()
        counts_PME = per_pass.dump()["logical_count"][:, list(spec.moe_layers)]
        union_PM = (counts_PME > 0).sum(dim=-1).double()  # distinct experts of each pass and MoE layer
        per_expert = self.llm.hybrid.tier_bytes().cpu_experts / max(1, spec.total_routed_experts)
        weights = bytes_per_token(self.llm)[1] - spec.top_k * spec.num_moe_layers * per_expert  # all but experts
        context = len(prompts[0]) + 1.5 * tokens
        experts_read = float(union_PM.sum(dim=1).mean()) * per_expert
        return {"step_s": step_s, "experts_per_layer": float(union_PM.mean()),
                "bytes": int(weights + experts_read + len(prompts) * self._kv_bytes(context))}

    def read_rate(self, reps: int = 3) -> float | None:
        """Bytes/s of the best of `reps` STREAM-style reads of 1 GiB by the model's own kernel thread team (its
        threads, pinning and task split: csrc/probes.cpp), in this process; None where the model computes on no
        team (no packed linears, or a tree without the probe)."""
        team = next((m.team() for m in self.llm.hybrid.model.modules() if type(m).__name__ == "QuantizedLinear"),
                    None)  # every packed linear computes on the one team
        if team is None or not hasattr(team, "read_seconds"):
            return None
        buffer = torch.ones(PROBE_BYTES // 8, dtype=torch.int64)
        return PROBE_BYTES / team.read_seconds(buffer, reps)

    def held_out_rows(self, num: int, max_tokens: int) -> list[list[int]]:
        """Token ids of `num` GSM8K questions in the model's chat template (the text bench_format_loss scores)."""
        prompts = select(load_prompts("gsm8k"), num=num, seed=0, min_chars=40)
        rows = [self.llm.chat_prompt_ids([{"role": r, "content": c} for r, c in p.messages])[:max_tokens]
                for p in prompts]
        return [r for r in rows if len(r) > 1]

    def loss(self, rows: list[list[int]]) -> float:
        """Mean next-token cross-entropy (nats), teacher-forced."""
        return held_out_loss(self.llm, [torch.tensor([r]) for r in rows])

    def close(self) -> None:
        self.llm.close()
