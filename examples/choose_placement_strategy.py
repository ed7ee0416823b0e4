"""Choosing a placement strategy: record statistics on the bundled model, then compare strategies on held-out text.

    python examples/choose_placement_strategy.py [--num-prompts 12] [--max-tokens 24]

1. record routing statistics (`stat` mode) on a calibration sample of ShareGPT prompts;
2. record the same on a held-out sample (other conversations);
3. for each GPU-expert ratio, place experts with each strategy from the calibration statistics and measure the
   GPU hit rate it would have had on the held-out routing.
"""

import argparse

import torch

import tiermoe
from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.data import load_prompts, select
from tiermoe.placement.budget import total_gpu_experts
from tiermoe.placement.metrics import hit_rate
from tiermoe.placement.strategies import place
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder

STRATEGIES = ("uniform", "front-loading", "random", "frequency", "balanced")
RATIOS = (0.125, 0.25, 0.5, 0.75)


def record(llm, spec, prompts, max_tokens) -> torch.Tensor:
    """Routed (token, expert) counts [L, E] of running `prompts` through the model."""
    recorder = make_recorder("stat", ModelShape.of(spec), buffer_size=-1)
    llm.engine.set_recorder(recorder)
    conversations = [[{"role": r, "content": c} for r, c in p.messages] for p in prompts]
    llm.generate([llm.chat_prompt_ids(c) for c in conversations], tiermoe.SamplingParams(max_tokens=max_tokens))
    return recorder.dump()["logical_count"].sum(dim=0).double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    model_dir = resolve_model(None)
    spec = detect(load_config(model_dir))
    sharegpt = load_prompts("sharegpt")
    calibration = select(sharegpt, args.num_prompts, seed=0, max_chars=800, part="train")
    held_out = select(sharegpt, args.num_prompts, seed=0, max_chars=800, part="heldout")
    with tiermoe.LLM(model_dir, progress=False) as llm:
        counts = record(llm, spec, calibration, args.max_tokens)
        truth = record(llm, spec, held_out, args.max_tokens)
    rows = spec.moe_row_mask()
    print(f"calibration: {int(counts.sum())} routed pairs; held-out: {int(truth.sum())} routed pairs\n")
    print("GPU ratio  " + "".join(f"{s:>15}" for s in STRATEGIES))
    for ratio in RATIOS:
        total = total_gpu_experts(spec.num_moe_layers, spec.num_experts, ratio=ratio)
        rates = [hit_rate(place(s, rows, spec.num_experts, total, counts), truth) for s in STRATEGIES]
        print(f"{ratio:<11.3f}" + "".join(f"{100 * r:>14.1f}%" for r in rates))
    print("\n(hit rate = share of held-out routed pairs the GPU tier would serve)")


if __name__ == "__main__":
    main()
