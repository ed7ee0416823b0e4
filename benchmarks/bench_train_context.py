"""`tiermoe fit --train`'s longest context, confirmed: one LoRA training step at that length (or --tokens) and its
peak resident memory against the budget.

1. `tiermoe fit --model M --train --ram-gb G` (a child process) predicts the longest context N and prints its terms;
2. a fresh child process loads M for training (every expert on the CPU tier, LoRA rank --lora-rank on all linears and
   every expert, gradient checkpointing), runs one step at N tokens (forward, backward, AdamW) and reads its peak
   resident memory (VmHWM);
3. the table: predicted bytes at N (the budget when N is the prediction) against the peak.

    python benchmarks/bench_train_context.py --model runs/q30-2 --ram-gb 8
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

GIB = 1 << 30


def predicted(model: str, ram_gb: float, rank: int) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "tiermoe.cli.main", "fit", "--model", model, "--train", "--ram-gb",
                           str(ram_gb), "--lora-rank", str(rank)], capture_output=True, text=True, check=True)
    tokens = int(re.search(r"longest context\s+([\d,]+) tokens", done.stdout).group(1).replace(",", ""))
    return tokens, done.stdout


def one_step(model: str, tokens: int, rank: int) -> None:
    """In this process: one training step at `tokens`; prints the peak resident bytes."""
    import torch
    from peft import LoraConfig

    from tiermoe.model.loader import load_hybrid_model
    from tiermoe.training.lora import apply_lora

    with load_hybrid_model(model, None, gpu_device="cpu", progress=False, trainable=True) as hybrid:
        peft_model = apply_lora(hybrid, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))
        peft_model.gradient_checkpointing_enable()
        peft_model.train()
        optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, hybrid.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
        loss = peft_model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
    status = Path("/proc/self/status").read_text()
    print("PEAK", int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024, "LOSS", loss.item())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (e.g. tiermoe make-model --preset "
                                                  "qwen3-30b-a3b --layers 2 --out runs/q30-2)")
    p.add_argument("--ram-gb", type=float, required=True, help="the host-memory budget to predict for, GiB")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--tokens", type=int, help="run the step at this length (default: the predicted longest)")
    p.add_argument("--step", type=int, help=argparse.SUPPRESS)  # the child's mode: one step at this length
    args = p.parse_args()
    if args.step:
        one_step(args.model, args.step, args.lora_rank)
        return
    longest, report = predicted(args.model, args.ram_gb, args.lora_rank)
    print(report)
    tokens = args.tokens or longest
    done = subprocess.run([sys.executable, __file__, "--model", args.model, "--ram-gb", str(args.ram_gb),
                           "--lora-rank", str(args.lora_rank), "--step", str(tokens)], capture_output=True, text=True,
                          check=True)
    peak = int(re.search(r"PEAK (\d+)", done.stdout).group(1))
    budget = int(args.ram_gb * GIB)
    expected = budget if tokens == longest else None
    print("| budget GiB | predicted longest | tokens run | peak RSS GiB | peak / budget |")
    print("|---|---|---|---|---|")
    ratio = f"{peak / expected:.3f}" if expected else "-"
    print(f"| {args.ram_gb:g} | {longest:,} | {tokens:,} | {peak / GIB:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
