"""What quantised non-expert weights (--non-expert-dtype) cost in quality and buy in bytes and decode speed, CPU only.

The bundled model (or --model) is loaded CPU-only (gpu_device "cpu", every routed expert on the CPU tier, in the
checkpoint's dtype) once per configuration: non-expert linears as loaded (torch's, --non-expert-dtype none), or packed
bf16 / int8 / int4 (tiermoe.model.non_expert_quant), with the experts bf16 (bf16 also with an int4 LM head alone), the
"8-bit model" (int8 non-experts and experts, what a llama.cpp Q8_0 file is) and
the "4-bit model": int4 non-experts with int4 experts (--cpu-expert-dtype int4), what a llama.cpp Q4_K_M file is, with
its key / value projections int8, attention's output, the LM head and the experts' down projections int6 (the
default, as Q4_K_M keeps more bits there), with its downs int4 too (--cpu-expert-down-dtype int4), its head int4 too
(--head-dtype int4), every non-expert linear int8, and int6 throughout. For each: the
held-out loss (nats) of the same GSM8K prompts bench_format_loss.py scores (the demo model never saw them), its change
against the unquantised model, the KL divergence from the unquantised model's next-token distribution and how often
their top tokens agree (the loss of a small model moves by chance either way under a few per mille of weight error;
the KL does not), the non-expert bytes held, and the weight bytes one decode token reads (non-expert linears and head,
plus top-k experts per MoE layer; an embedding row is negligible). Then decode speed: the same greedy generations
(ignore_eos, fixed length) for every configuration, alternating within each round, best of the rounds.

Beside them, llama.cpp's formats of the same checkpoint where llama-cpp-python is installed (--no-llama-cpp: not):
its bf16 GGUF (llama.cpp's own converter), and Q8_0 and Q4_K_M quantised from it by llama.cpp (files cached, see
benchmarks/e2e/llama_cpp.py), each scored on the same prompts against the same unquantised tiermoe model (loss, KL,
top token; llama.cpp in a process of its own), with the weight bytes a token reads from the file, and a second table
of the type llama.cpp gave each kind of tensor: its mixes keep some tensors at more bits (Q4_K_M's output matrix
and some value and down projections at Q6_K), and a row width that is not a multiple of its block (256 for the
K-quants) falls back to another type. Their decode speed is bench_e2e_cpu.py's.

    python benchmarks/bench_non_expert_quant.py                      # bundled model, 64 prompts, 3 rounds
    python benchmarks/bench_non_expert_quant.py --model DIR --num-prompts 32 --rounds 5 --tokens 128
    python benchmarks/bench_non_expert_quant.py --rounds 0           # quality and bytes only, no speed runs
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_format_loss import prompt_rows  # noqa: E402  (the held-out prompts that benchmark scores)
from e2e.llama_cpp import (  # noqa: E402
    QUANT_TYPES,
    cached_gguf,
    cached_quantized,
    gguf_bytes_per_token,
    llama_cpp_installed,
    missing_message,
    tensor_types,
)
from e2e.side_process import SideError, Worker  # noqa: E402
from support.decode_rounds import decode_speed, print_load_average  # noqa: E402

from tiermoe import LLM  # noqa: E402
from tiermoe.arch import detect, load_config  # noqa: E402
from tiermoe.bundled import resolve_model  # noqa: E402
from tiermoe.config import CPUConfig  # noqa: E402
from tiermoe.model import non_expert_quant  # noqa: E402
from tiermoe.model.non_expert_quant import INT8_IN_INT4, head_format, linear_format  # noqa: E402
from tiermoe.placement.plan import PlacementPlan  # noqa: E402

# (label, --non-expert-dtype, --cpu-expert-dtype, --head-dtype, --cpu-expert-down-dtype); the first is the baseline
CONFIGS = (
    ("as loaded", "none", None, None, None),  # torch's linears (a bf16 model's default packs them in bf16)
    ("bf16", "bf16", None, None, None),
    ("bf16, head int4", "bf16", None, "int4", None),  # what the int4 head alone changes
    ("int8", "int8", None, None, None),
    ("int8, experts int8", "int8", "int8", None, None),  # the 8-bit model: what a llama.cpp Q8_0 file is
    ("int4", "int4", None, None, None),  # k / v int8, o and the head int6 (non_expert_quant.linear_format, head_format)
    ("int4, experts int4", "int4", "int4", None, None),  # the 4-bit model: the experts' downs int6
    ("int4, experts int4 throughout", "int4", "int4", None, "int4"),  # what the int6 downs buy
    ("int4, experts int4, head int4", "int4", "int4", "int4", None),  # what the int6 head buys
    ("int8, experts int4 throughout", "int8", "int4", None, "int4"),  # 4-bit experts, 8-bit the rest
    ("int6, experts int6", "int6", "int6", None, None),  # 6.5 bits throughout
)


def linears_label(ne: str) -> str | None:
    """The decoder linears' format(s) --non-expert-dtype `ne` packs (None: as loaded)."""
    if ne == "none":
        return None
    other = {}
    # getattr: bench_e2e_cpu.py --compare-commit runs this file against older trees, which had no int6
    for leaf in (*INT8_IN_INT4, *getattr(non_expert_quant, "INT6_IN_INT4", ())):
        if linear_format(leaf, ne) != ne:
            other.setdefault(linear_format(leaf, ne), []).append(leaf)
    return ", ".join([ne, *(f"{' / '.join(leaves)} {fmt}" for fmt, leaves in other.items())])


def experts_label(ex: str | None, down: str | None) -> str:
    """The routed experts' format(s) (--cpu-expert-dtype, --cpu-expert-down-dtype)."""
    if ex is None:
        return "as loaded"
    down = CPUConfig(expert_dtype=ex, expert_down_dtype=down).down_format
    return ex if down == ex else f"{ex}, down {down}"


def head_label(ne: str, head: str | None) -> str | None:
    """The packed LM head's format (None: as loaded)."""
    return None if ne == "none" else head_format(ne, head)


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


def llama_cpp_quality(model_dir: Path, rows: list[torch.Tensor], reference: list[torch.Tensor]) -> dict:
    """llama.cpp's bf16, Q8_0 and Q4_K_M of the checkpoint against `reference` (log_probs of the unquantised
    model): per format its quality (LlamaSide.quality), the weight bytes a decode token reads and its tensor types;
    a format llama.cpp fails on gets its one-line reason instead."""
    threads = os.cpu_count() or 1
    ids = [r[0].tolist() for r in rows]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = Path(tmp) / "reference.npy"
        np.save(ref_path, torch.cat(reference).numpy())
        for kind in ("bf16", *QUANT_TYPES):
            label = f"llama.cpp {kind}"
            try:
                path = cached_gguf(model_dir) if kind == "bf16" else cached_quantized(model_dir, kind, threads)
                side = Worker(label, "llama.cpp", {"path": str(path), "threads": threads, "context": 256}, None)
            except (SideError, SystemExit) as err:
                out[label] = {"error": str(err)}
                print(f"{label}: {err}", flush=True)
                continue
            try:
                out[label] = {**side.call("quality", rows=ids, reference=str(ref_path)),
                              "read": gguf_bytes_per_token(path, 0), "types": tensor_types(path)}
            except SideError as err:
                out[label] = {"error": str(err)}
            finally:
                side.close()
            print(f"{label}: {out[label].get('error') or 'scored'}", flush=True)
    return out


def print_llama_cpp(results: dict, base_loss: float) -> None:
    """llama.cpp's rows of the quality table, then the types it gave each kind of tensor."""
    for label, r in results.items():
        if "error" in r:
            print(f"| {label} | | | not run: {r['error']} | | | | | | | |")
            continue
        print(f"| {label} (GGUF) | (the file's) | (the file's) | {r['loss']:.4f} | {r['loss'] - base_loss:+.4f} | "
              f"{r['kl']:.5f} | {r['top1']:.1%} | - | {r['read'] / 2**20:.2f} | - | - |")
    typed = {label: r["types"] for label, r in results.items() if "types" in r}
    if not typed:
        return
    kinds = list(dict.fromkeys(k for types in typed.values() for k in types))
    print("\nllama.cpp's type for each kind of tensor (several where its layers differ):\n")
    print("| tensor | " + " | ".join(typed) + " |")
    print("|---|" + "---|" * len(typed))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(", ".join(types.get(kind, ["-"])) for types in typed.values()) + " |")


def add_scoring_flags(p: argparse.ArgumentParser) -> None:
    """The model and the held-out prompts a quality benchmark scores (this one's and bench_format_mix.py's)."""
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--num-prompts", type=int, default=64, help="held-out prompts scored (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens scored per prompt at most (default 256)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_non_expert_quant.py --rounds 5",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_scoring_flags(p)
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together in the speed runs (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence per speed run (default 64)")
    p.add_argument("--rounds", type=int, default=3,
                   help="alternating speed rounds; the best counts (default 3; 0: no speed runs)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out llama.cpp's formats")
    p.add_argument("--cpu-threads", type=int, default=None, help="kernel threads (default: tiermoe's default)")
    args = p.parse_args()
    if args.rounds < 0 or min(args.num_prompts, args.max_tokens, args.batch, args.tokens) < 1:
        p.error("--rounds must be >= 0, and --num-prompts, --max-tokens, --batch and --tokens >= 1")

    model_dir = resolve_model(args.model)
    spec = detect(load_config(model_dir))
    print_load_average("before")
    rows = prompt_rows(model_dir, args.num_prompts, args.max_tokens)
    print(f"{len(rows)} GSM8K prompts, {sum(r.shape[1] - 1 for r in rows)} scored tokens", flush=True)
    all_cpu = PlacementPlan.all_cpu(spec.num_layers, spec.num_experts)
    llms = {label: LLM(model_dir, placement=all_cpu, progress=False,
                       cpu=CPUConfig(non_expert_dtype=ne, expert_dtype=ex, head_dtype=head,
                                     expert_down_dtype=down, threads=args.cpu_threads))
            for label, ne, ex, head, down in CONFIGS}
    try:
        losses = {label: held_out_loss(llm, rows) for label, llm in llms.items()}
        reference = list(log_probs(llms[CONFIGS[0][0]], rows))
        divergences = {label: divergence(llm, rows, reference) for label, llm in llms.items()}
        sizes = {label: bytes_per_token(llm) for label, llm in llms.items()}
        speed = (decode_speed(llms, [r[0, :16].tolist() for r in rows[:args.batch]], args.tokens, args.rounds)
                 if args.rounds else {})
    finally:
        for llm in llms.values():
            llm.close()
    llama = {}
    if not args.no_llama_cpp:
        if llama_cpp_installed():
            llama = llama_cpp_quality(model_dir, rows, reference)
        else:
            print(missing_message(), flush=True)
    print_load_average("after")

    base = CONFIGS[0][0]
    print(f"\n| non-expert linears | LM head | experts | held-out loss (nats) | vs as loaded | KL from as loaded "
          f"(nats/token) | top token as loaded's | non-expert MiB | weights read per token, MiB | decode tok/s "
          f"(batch {args.batch}) | vs as loaded |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, ne, ex, head, down in CONFIGS:
        held, read = sizes[label]
        kl, agree = divergences[label]
        loaded = f"as loaded ({str(spec.dtype).removeprefix('torch.')})"
        tok_s = f"{speed[label]:.1f} | {speed[label] / speed[base]:.2f}x" if speed else "- | -"
        print(f"| {linears_label(ne) or loaded} | {head_label(ne, head) or loaded} | {experts_label(ex, down)} | "
              f"{losses[label]:.4f} | "
              f"{losses[label] - losses[base]:+.4f} | {kl:.5f} | {agree:.1%} | {held / 2**20:.2f} | "
              f"{read / 2**20:.2f} | {tok_s} |")
    print_llama_cpp(llama, losses[base])


if __name__ == "__main__":
    main()
