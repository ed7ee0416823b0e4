"""Which 4-bit mix would be as good as llama.cpp's Q4_K_M: per-projection format mixes simulated on the demo model.

bench_non_expert_quant.py scores the mixes tiermoe packs (int4 keeps k / v int8, o, the head and the experts' downs
int6). This one asks, before anyone builds a format or a flag, what a mix would give (it is how int6 was chosen):
every weight of the model is rounded through a format and back, per projection (q, k, v, o; the experts' gate / up
and down, per layer; the LM head), and the model runs on the rounded weights, held in its own dtype (bf16: one more
rounding of each, 2^-9 of it, small beside a 4- or 8-bit code's), the head's product in fp32. The formats:
tiermoe's packed bf16 / int8 / int4 / int6 (`quantize` then `dequantize`: the stored codes exactly), and `q6`, a
6-bit form like llama.cpp's Q6_K (symmetric 6-bit codes in groups of 16 columns, each group's scale 8 bits of its
row's largest). What the simulation leaves out: the int8 rounding of activations in the packed products; the mixes
marked packable are what bench_non_expert_quant.py loads, and its packed rows of them differ from the simulation by
about 0.00001-0.00006 nats.

Each mix: the KL from the unquantised model's next-token distribution and the top-token agreement on the held-out
GSM8K prompts bench_non_expert_quant.py scores, and the weight bytes one decode token reads at the mix's formats
(every decoder linear, the routers as loaded, the head, top-k experts per MoE layer: the packed formats' bytes, 6
bits and a byte per 16 weights for q6), beside llama.cpp's Q4_K_M of the same checkpoint where llama-cpp-python is
installed. Quality only: nothing is timed, and the figures do not depend on load.

    python benchmarks/bench_format_mix.py                      # the bundled model, 64 prompts
    python benchmarks/bench_format_mix.py --num-prompts 16 --no-llama-cpp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# the held-out prompts the quality benchmarks score
from bench_format_loss import prompt_rows
from bench_non_expert_quant import (
    add_scoring_flags,
    divergence,
    llama_cpp_quality,
    log_probs,
)
from e2e.llama_cpp import llama_cpp_installed, missing_message

from tiermoe import LLM
from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.config import CPUConfig
from tiermoe.experts.quant import dequantize, quantize
from tiermoe.experts.weights import ExpertWeights
from tiermoe.placement.plan import PlacementPlan

Q6_GROUP = 16  # columns per 6-bit group, as Q6_K's
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
# (label, {q_proj, k_proj, v_proj, o_proj: format}, experts' gate / up, down, head). down "more-bits:A/B": A in the
# layers where llama.cpp's Q4_K_M gives a down projection more bits (more_bits_layers), B elsewhere.
# "4-bit default" is the mix int4 packed before int6 was built (o int4, the head int8, the experts' downs int4)
DEFAULT_4BIT = {"q_proj": "int4", "k_proj": "int8", "v_proj": "int8", "o_proj": "int4"}
INT8 = dict.fromkeys(PROJECTIONS, "int8")
O_Q6 = dict(DEFAULT_4BIT, o_proj="q6")
O_INT6 = dict(DEFAULT_4BIT, o_proj="int6")
MIXES = (
    ("4-bit default (packable)", DEFAULT_4BIT, "int4", "int4", "int8"),
    ("int8 decoder linears, int4 experts (packable)", INT8, "int4", "int4", "int8"),
    ("4-bit default, 6-bit head", DEFAULT_4BIT, "int4", "int4", "q6"),
    ("int8 decoder linears, int4 experts, 6-bit head", INT8, "int4", "int4", "q6"),
    ("4-bit default, down int8 where Q4_K_M has more bits", DEFAULT_4BIT, "int4", "more-bits:int8/int4", "int8"),
    ("4-bit default, down int8", DEFAULT_4BIT, "int4", "int8", "int8"),
    ("4-bit default, down int8, 6-bit head", DEFAULT_4BIT, "int4", "int8", "q6"),
    ("4-bit default, o and head 6-bit", O_Q6, "int4", "int4", "q6"),
    ("4-bit default, o, down and head 6-bit", O_Q6, "int4", "q6", "q6"),
    ("4-bit default, o and head 6-bit, down 6-bit where Q4_K_M has more bits", O_Q6, "int4", "more-bits:q6/int4",
     "q6"),
    ("o, down and head int6 (packable: the 4-bit model now)", O_INT6, "int4", "int6", "int6"),
)


def more_bits_layers(num_layers: int) -> set[int]:
    """The layers where llama.cpp's Q4_K_M keeps a down (and value) projection at more bits: the first and last
    eighth, and every third layer between."""
    eighth = num_layers // 8
    return {i for i in range(num_layers) if i < eighth or i >= 7 * num_layers // 8 or (i - eighth) % 3 == 2}


def six_bit(w: torch.Tensor) -> torch.Tensor:
    """A Q6_K-like round trip of w [N, K] (K a multiple of Q6_GROUP): symmetric 6-bit codes per group of Q6_GROUP
    columns, each group's scale 8 bits of its row's largest."""
    groups = w.float().reshape(w.shape[0], -1, Q6_GROUP)
    scale = groups.abs().amax(-1, keepdim=True) / 31.5
    row = (scale.amax(1, keepdim=True) / 127).clamp(min=1e-30)
    scale = (scale / row).round().clamp(1, 127) * row
    return ((groups / scale).round().clamp(-32, 31) * scale).reshape(w.shape)


def round_trip(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, int]:
    """`w` [N, K] through `fmt` and back (in w's dtype), and the bytes the format holds it in."""
    if fmt == "q6":
        if w.shape[1] % Q6_GROUP:
            raise SystemExit(f"q6 needs rows of a multiple of {Q6_GROUP} columns; a {tuple(w.shape)} matrix has not")
        return six_bit(w).to(w.dtype), w.numel() * 6 // 8 + w.numel() // Q6_GROUP + 4 * w.shape[0]
    q = quantize(w.float(), fmt)
    return dequantize(q, torch.float32)[: w.shape[0], : w.shape[1]].to(w.dtype), q.nbytes


def down_format(down: str, layer: int, more: set[int]) -> str:
    if not down.startswith("more-bits:"):
        return down
    more_fmt, other = down.removeprefix("more-bits:").split("/")
    return more_fmt if layer in more else other


def apply_mix(llm: LLM, spec, mix: tuple) -> tuple[int, torch.Tensor]:
    """Rounds the loaded model's weights through the mix's formats (the head is returned, not set: it is tied to
    the embedding); (the weight bytes one decode token reads, the head's rounded weight)."""
    _, linears, gate_up, down, head = mix
    model, more = llm.hybrid.model, more_bits_layers(spec.num_layers)
    read = 0
    with torch.no_grad():
        head_module = model.get_output_embeddings()
        for name, module in model.named_modules():
            leaf = name.rpartition(".")[2]
            if not isinstance(module, torch.nn.Linear) or module is head_module:
                continue
            if leaf in linears:
                module.weight.data, nbytes = round_trip(module.weight.data, linears[leaf])
                read += nbytes
            else:  # the routers: as loaded
                read += module.weight.numel() * module.weight.element_size()
        for layer, block in llm.hybrid.blocks.items():
            tier, sizes, fmt = block.cpu_tier, [], down_format(down, layer, more)
            for e in list(tier.experts):
                w = tier.pop(e)
                (gu, gu_bytes), (dn, dn_bytes) = round_trip(w.gate_up, gate_up), round_trip(w.down, fmt)
                sizes.append(gu_bytes + dn_bytes)
                tier.add(e, ExpertWeights(gu, dn, w.gate_up_bias, w.down_bias))
            read += spec.top_k * sum(sizes) // len(sizes)
        head_weight, head_bytes = round_trip(head_module.weight.data, head)
    return read + head_bytes, head_weight


def score_mix(model_dir: Path, spec, mix: tuple, rows, reference) -> dict:
    all_cpu = PlacementPlan.all_cpu(spec.num_layers, spec.num_experts)
    llm = LLM(model_dir, placement=all_cpu, progress=False, cpu=CPUConfig(non_expert_dtype="none"))
    try:
        read, head_weight = apply_mix(llm, spec, mix)
        head = llm.hybrid.model.get_output_embeddings()
        hook = head.register_forward_hook(lambda module, args, out: (args[0].float() @ head_weight.float().T)
                                          .to(out.dtype))
        try:
            kl, top = divergence(llm, rows, reference)
        finally:
            hook.remove()
        return {"kl": kl, "top1": top, "read": read}
    finally:
        llm.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_format_mix.py --num-prompts 16",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scoring_flags(p)
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's Q4_K_M")
    args = p.parse_args()
    if min(args.num_prompts, args.max_tokens) < 1:
        p.error("--num-prompts and --max-tokens must be >= 1")
    model_dir = resolve_model(args.model)
    spec = detect(load_config(model_dir))
    rows = prompt_rows(model_dir, args.num_prompts, args.max_tokens)
    print(f"{len(rows)} GSM8K prompts, {sum(r.shape[1] - 1 for r in rows)} scored tokens", flush=True)
    base = LLM(model_dir, placement=PlacementPlan.all_cpu(spec.num_layers, spec.num_experts), progress=False,
               cpu=CPUConfig(non_expert_dtype="none"))
    try:
        reference = list(log_probs(base, rows))
    finally:
        base.close()
    results = {}
    for i, mix in enumerate(MIXES, 1):
        results[mix[0]] = score_mix(model_dir, spec, mix, rows, reference)
        print(f"[{i}/{len(MIXES)}] {mix[0]}: KL {results[mix[0]]['kl']:.5f}", flush=True)
    llama = {}
    if not args.no_llama_cpp:
        if llama_cpp_installed():
            llama = {k: v for k, v in llama_cpp_quality(model_dir, rows, reference).items() if "Q4_K_M" in k}
        else:
            print(missing_message(), flush=True)

    print(f"\n'Where Q4_K_M has more bits': layers {sorted(more_bits_layers(spec.num_layers))} of "
          f"{spec.num_layers}.\n")
    print("| mix | q / k / v / o | experts' gate / up | down | head | KL from as loaded (nats/token) | "
          "top token as loaded's | weights read per token, MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for label, linears, gate_up, down, head in MIXES:
        r = results[label]
        print(f"| {label} | {' / '.join(linears[p] for p in PROJECTIONS)} | {gate_up} | {down} | {head} | "
              f"{r['kl']:.5f} | {r['top1']:.1%} | {r['read'] / 2**20:.2f} |")
    for label, r in llama.items():
        if "error" in r:
            print(f"| {label} | not run: {r['error']} | | | | | | |")
        else:
            print(f"| {label} (GGUF) | (the file's) | | | | {r['kl']:.5f} | {r['top1']:.1%} | "
                  f"{r['read'] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
