"""DPO on the bundled demo model through TRL's DPOTrainer: the preference set is made from the demo's own held-out
conversations (prompt: a conversation's first user turn; chosen: its real reply; rejected: the reply of another
conversation), experts on both tiers, LoRA on attention, routers and every routed expert, the reference being the
same model with its adapter switched off (no second copy of the experts). Prints the DPO loss and the reward
accuracy of every step, and the held-out pairs' reward margin before and after.

    python benchmarks/bench_dpo_demo.py --pairs 64 --steps 20
    python benchmarks/bench_dpo_demo.py --cpu-expert-dtype bf16   # the CPU tier on the native kernels
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoTokenizer
from trl import DPOConfig, DPOTrainer

from tiermoe.arch import detect, load_config
from tiermoe.bundled import BUNDLED_MODEL_DIR
from tiermoe.config import CPUConfig
from tiermoe.data.demo_split import demo_conversations
from tiermoe.model.loader import load_hybrid_model
from tiermoe.training.lora import apply_lora


def preference_pairs(count: int, seed: int) -> list[dict]:
    """(prompt, chosen, rejected) in chat messages: the real reply against another conversation's reply."""
    convs = [c["messages"] for c in demo_conversations("heldout")
             if len(c["messages"]) >= 2 and c["messages"][0]["role"] == "user"
             and c["messages"][1]["role"] == "assistant"]
    rng = random.Random(seed)
    rng.shuffle(convs)
    convs = convs[:count]
    pairs = []
    for i, conv in enumerate(convs):
        other = convs[(i + 1) % len(convs)]
        pairs.append({"prompt": [conv[0]], "chosen": [conv[1]], "rejected": [other[1]]})
    return pairs


def margins(trainer: DPOTrainer, data: Dataset) -> float:
    """Mean reward margin beta * ((chosen - ref chosen) - (rejected - ref rejected)) over `data`."""
    metrics = trainer.evaluate(data)
    return metrics["eval_rewards/margins"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=64, help="preference pairs to train on (default 64)")
    parser.add_argument("--eval-pairs", type=int, default=16, help="pairs held out for the margin (default 16)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--cpu-expert-dtype", default=None, help="bf16 | int8 | int4 (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not 1 <= args.pairs + args.eval_pairs <= 10_000 or not 1 <= args.steps <= 100_000:
        parser.error("expected 1-10,000 pairs in all and 1-100,000 steps")

    torch.manual_seed(args.seed)
    pairs = preference_pairs(args.pairs + args.eval_pairs, args.seed)
    train, held = Dataset.from_list(pairs[:args.pairs]), Dataset.from_list(pairs[args.pairs:])
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    spec = detect(load_config(BUNDLED_MODEL_DIR))
    gen = torch.Generator().manual_seed(args.seed)
    mask = torch.rand(spec.num_layers, spec.num_experts, generator=gen) < 0.5  # half the experts on each tier
    with load_hybrid_model(BUNDLED_MODEL_DIR, mask, gpu_device="cpu", dtype=torch.float32, progress=False,
                           cpu=CPUConfig(expert_dtype=args.cpu_expert_dtype), trainable=True) as hybrid:
        model = apply_lora(hybrid, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
        with tempfile.TemporaryDirectory() as out:
            dpo = DPOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=args.steps, bf16=False,
                            learning_rate=args.lr, per_device_train_batch_size=args.batch_size,
                            per_device_eval_batch_size=args.batch_size, logging_steps=1, save_strategy="no",
                            beta=args.beta, max_length=args.max_length, seed=args.seed,
                            router_aux_loss_coef=0.0)  # the loss is DPO's alone (TRL adds the MoE aux loss)
            trainer = DPOTrainer(model=model, ref_model=None, args=dpo, train_dataset=train, eval_dataset=held,
                                 processing_class=tok)
            before = margins(trainer, held)
            start = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - start
            after = margins(trainer, held)
    logs = [h for h in trainer.state.log_history if "loss" in h and "eval_loss" not in h]
    print("| step | DPO loss | reward accuracy |")
    print("|---:|---:|---:|")
    for h in logs:
        print(f"| {h['step']} | {h['loss']:.4f} | {h.get('rewards/accuracies', float('nan')):.2f} |")
    print(f"\nheld-out reward margin: {before:+.4f} before -> {after:+.4f} after ({len(held)} pairs); "
          f"{args.steps} steps of {args.batch_size} pairs in {seconds:.1f} s; CPU tier "
          f"{args.cpu_expert_dtype or 'as the checkpoint (torch)'}; no reference model: {trainer.ref_model is None}")


if __name__ == "__main__":
    main()
