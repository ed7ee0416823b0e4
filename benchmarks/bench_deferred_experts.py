"""What deferred experts (--kt-max-deferred-experts-per-token d) cost in quality and buy in decode speed.

Every routed expert on the CPU tier (deferral only touches CPU-tier experts). For each d, the same held-out prompts
(GSM8K questions in the model's chat template; the bundled model never saw them) are scored teacher-forced:
mean next-token loss (nats) and its change against d = 0, mean KL(p_0 || p_d) per token, and how often the top-1
token agrees with d = 0's. Then decode speed: the same greedy generations (ignore_eos, fixed length) for each d,
alternating rounds, as tokens/s and the ratio to d = 0. Deferral only pays where the next layer's attention has
something to overlap the deferred job with; on a CPU-only run the main thread and the CPU tier share the cores.

    python benchmarks/bench_deferred_experts.py                        # bundled model, d = 0..top-k
    python benchmarks/bench_deferred_experts.py --model DIR --deferred 0,1,2,4 --num-prompts 32 --rounds 5
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


def quality(llms: dict[int, LLM], rows: list[torch.Tensor]) -> dict[int, dict[str, float]]:
    """Loss, KL against d = 0 and top-1 agreement with d = 0, per d, over every scored position of `rows`."""
    sums = {d: {"loss": 0.0, "kl": 0.0, "agree": 0.0} for d in llms}
    count = 0
    with torch.inference_mode():
        for ids in rows:
            logp = {d: F.log_softmax(llm.hybrid(input_ids=ids).logits[0, :-1].float(), dim=-1) for d, llm in llms.items()}
            exact = logp[0]
            for d, lp in logp.items():
                sums[d]["loss"] += F.nll_loss(lp, ids[0, 1:], reduction="sum").item()
                sums[d]["kl"] += (exact.exp() * (exact - lp)).sum().item()
                sums[d]["agree"] += (lp.argmax(-1) == exact.argmax(-1)).sum().item()
            count += ids.shape[1] - 1
    return {d: {k: v / count for k, v in s.items()} for d, s in sums.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Example: python benchmarks/bench_deferred_experts.py --deferred 0,1,2 "
                                       "--rounds 5", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--deferred", help="values of d, comma-separated, 0 first (default: 0 .. the model's top-k)")
    p.add_argument("--num-prompts", type=int, default=64, help="held-out prompts scored (default 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens scored per prompt at most (default 256)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoding together in the speed runs (default 1)")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per sequence per speed run (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="alternating speed rounds; the best counts (default 3)")
    args = p.parse_args()

    model_dir = resolve_model(args.model)
    spec = detect(load_config(model_dir))
    top_k = spec.top_k
    values = [int(v) for v in args.deferred.split(",")] if args.deferred else list(range(top_k + 1))
    if values[0] != 0 or any(not 0 <= d <= top_k for d in values):
        p.error(f"--deferred: values in 0..{top_k} (the model's top-k), 0 first")
    print_load_average("before")
    rows = prompt_rows(model_dir, args.num_prompts, args.max_tokens)
    print(f"{len(rows)} GSM8K prompts, {sum(r.shape[1] - 1 for r in rows)} scored tokens; top-k {top_k}", flush=True)
    all_cpu = PlacementPlan.all_cpu(spec.num_layers, spec.num_experts)
    llms = {d: LLM(model_dir, placement=all_cpu, progress=False, cpu=CPUConfig(deferred_experts=d))
            for d in values}
    try:
        scores = quality(llms, rows)
        labelled = {f"d={d}": llm for d, llm in llms.items()}
        speed = decode_speed(labelled, [r[0, :16].tolist() for r in rows[:args.batch]], args.tokens, args.rounds)
    finally:
        for llm in llms.values():
            llm.close()
    print_load_average("after")

    print(f"\n| d (of top-{top_k}) | held-out loss (nats) | vs d=0 | KL(p_0 \\|\\| p_d) (nats/token) | top-1 = d=0's "
          f"| decode tok/s (batch {args.batch}) | vs d=0 |")
    print("|---|---|---|---|---|---|---|")
    for d in values:
        s = scores[d]
        print(f"| {d} | {s['loss']:.4f} | {s['loss'] - scores[0]['loss']:+.4f} | {s['kl']:.4f} | "
              f"{100 * s['agree']:.1f}% | {speed[f'd={d}']:.1f} | {speed[f'd={d}'] / speed['d=0']:.2f}x |")


if __name__ == "__main__":
    main()
