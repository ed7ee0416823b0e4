"""What quantised non-expert weights (--non-expert-dtype) cost in quality and buy in bytes and decode speed, CPU only.

The bundled model (or --model) is loaded CPU-only (gpu_device "cpu", every routed expert on the CPU tier, in the
checkpoint's dtype) once per configuration: non-expert linears as loaded (torch's, --non-expert-dtype none), or packed
bf16 / int8 / int4 (tiermoe.model.non_expert_quant), with the experts bf16 (bf16 also with an int4 LM head alone), and
the "4-bit model": int4 non-experts with int4 experts (--cpu-expert-dtype int4), what a llama.cpp Q4_K_M file is, with
its LM head int4 (the default) and int8 (--head-dtype int8, nearer Q4_K_M's 6-bit output matrix). For each: the
held-out loss (nats) of the same GSM8K prompts bench_format_loss.py scores (the demo model never saw them), its change
against the unquantised model, the KL divergence from the unquantised model's next-token distribution and how often
their top tokens agree (the loss of a small model moves by chance either way under a few per mille of weight error;
the KL does not), the non-expert bytes held, and the weight bytes one decode token reads (non-expert linears and head,
plus top-k experts per MoE layer; an embedding row is negligible). Then decode speed: the same greedy generations
(ignore_eos, fixed length) for every configuration, alternating within each round, best of the rounds.

    python benchmarks/bench_non_expert_quant.py                      # bundled model, 64 prompts, 3 rounds
    python benchmarks/bench_non_expert_quant.py --model DIR --num-prompts 32 --rounds 5 --tokens 128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_format_loss import prompt_rows  # noqa: E402  (the held-out prompts that benchmark scores)
from support.decode_rounds import decode_speed, print_load_average  # noqa: E402

from tiermoe import LLM  # noqa: E402
from tiermoe.arch import detect, load_config  # noqa: E402
from tiermoe.bundled import resolve_model  # noqa: E402
from tiermoe.config import CPUConfig  # noqa: E402
from tiermoe.placement.plan import PlacementPlan  # noqa: E402

# (label, --non-expert-dtype, --cpu-expert-dtype, --head-dtype); the first is the baseline
CONFIGS = (
    ("as loaded", "none", None, None),  # torch's linears (a bf16 model's default packs them in bf16)
    ("bf16", "bf16", None, None),
    ("bf16, head int4", "bf16", None, "int4"),  # what the int4 head alone changes
    ("int8", "int8", None, None),
    ("int4", "int4", None, None),
    ("int4, experts int4", "int4", "int4", None),
    ("int4, experts int4, head int8", "int4", "int4", "int8"),
)


def held_out_loss(llm: LLM, rows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy (nats) over every scored token of `rows`."""
    total, count = 0.0, 0
    for ids, log_p in zip(rows, log_probs(llm, rows)):
        total += F.nll_loss(log_p, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count


def log_probs(llm: LLM, rows: list[torch.Tensor]):
    """Per row of `rows`: the next-token log-probabilities [T - 1, V] (fp32) of every scored position."""
    with torch.inference_mode():
        for ids in rows:
            yield F.log_softmax(llm.hybrid(input_ids=ids).logits[0, :-1].float(), dim=-1)


def divergence(llm: LLM, rows: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[float, float]:
    """(mean KL(reference || llm) in nats per token, share of positions whose most likely token is the
    reference's) over the scored positions of `rows`; `reference` is what `log_probs` gave for another model."""
    kl, same, count = 0.0, 0, 0
    for ref, log_p in zip(reference, log_probs(llm, rows)):
        kl += F.kl_div(log_p, ref, log_target=True, reduction="sum").item()
        same += int((ref.argmax(-1) == log_p.argmax(-1)).sum())
        count += ref.shape[0]
    return kl / count, same / count


def bytes_per_token(llm: LLM) -> tuple[int, int]:
    """(non-expert bytes held, weight bytes one decode token reads): everything held but the embedding table
    (one row of it is read; the whole table where it is also the LM head), plus the top-k experts of each MoE
    layer at the CPU tier's bytes per expert."""
    hybrid, spec = llm.hybrid, llm.hybrid.spec
    held = hybrid.tier_bytes()
    embedding = hybrid.model.get_input_embeddings().weight
    head_is_table = getattr(hybrid.model.get_output_embeddings(), "weight", None) is embedding
    table = 0 if head_is_table else embedding.numel() * embedding.element_size()
    per_expert = held.cpu_experts / max(1, spec.total_routed_experts)
    return held.non_expert, int(held.non_expert - table + spec.top_k * spec.num_moe_layers * per_expert)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_non_expert_quant.py --rounds 5",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--num-prompts", type=int, default=64, help="held-out prompts scored (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens scored per prompt at most (default 256)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together in the speed runs (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence per speed run (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="alternating speed rounds; the best counts (default 3)")
    p.add_argument("--cpu-threads", type=int, default=None, help="kernel threads (default: tiermoe's default)")
    args = p.parse_args()

    model_dir = resolve_model(args.model)
    spec = detect(load_config(model_dir))
    print_load_average("before")
    rows = prompt_rows(model_dir, args.num_prompts, args.max_tokens)
    print(f"{len(rows)} GSM8K prompts, {sum(r.shape[1] - 1 for r in rows)} scored tokens", flush=True)
    all_cpu = PlacementPlan.all_cpu(spec.num_layers, spec.num_experts)
    llms = {label: LLM(model_dir, placement=all_cpu, progress=False,
                       cpu=CPUConfig(non_expert_dtype=ne, expert_dtype=ex, head_dtype=head,
                                     threads=args.cpu_threads))
            for label, ne, ex, head in CONFIGS}
    try:
        losses = {label: held_out_loss(llm, rows) for label, llm in llms.items()}
        reference = list(log_probs(llms[CONFIGS[0][0]], rows))
        divergences = {label: divergence(llm, rows, reference) for label, llm in llms.items()}
        sizes = {label: bytes_per_token(llm) for label, llm in llms.items()}
        speed = decode_speed(llms, [r[0, :16].tolist() for r in rows[:args.batch]], args.tokens, args.rounds)
    finally:
        for llm in llms.values():
            llm.close()
    print_load_average("after")

    base = CONFIGS[0][0]
    print(f"\n| non-expert linears | LM head | experts | held-out loss (nats) | vs as loaded | KL from as loaded "
          f"(nats/token) | top token as loaded's | non-expert MiB | weights read per token, MiB | decode tok/s "
          f"(batch {args.batch}) | vs as loaded |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, ne, ex, head in CONFIGS:
        held, read = sizes[label]
        kl, agree = divergences[label]
        loaded = f"as loaded ({str(spec.dtype).removeprefix('torch.')})"
        ne = None if ne == "none" else ne
        print(f"| {ne or loaded} | {head or ne or loaded} | {ex or 'as loaded'} | {losses[label]:.4f} | "
              f"{losses[label] - losses[base]:+.4f} | {kl:.5f} | {agree:.1%} | {held / 2**20:.2f} | "
              f"{read / 2**20:.2f} | {speed[label]:.1f} | {speed[label] / speed[base]:.2f}x |")


if __name__ == "__main__":
    main()
