"""A LoRA training step on a Qwen3-30B-A3B-shaped model: tiermoe (all routed experts on the CPU tier) against
transformers + PEFT on the same checkpoint, same LoRA config, same tokens; training tokens/s and peak memory.

Each measurement is a fresh process (so its peak resident memory is its own), and the contenders alternate round by
round (the machine is shared: a ratio measured side by side is what this reports, not an absolute speed). The LoRA
config is PEFT's "all-linear" (on transformers 5: attention, the router, and both fused expert parameters with
PEFT's ranks), KT's default SFT setting of LoRA on every routed expert.

    python benchmarks/bench_finetune.py --layers 2,4 --tokens 256 --steps 3 --rounds 2
    python benchmarks/bench_finetune.py --contenders tiermoe-native,tiermoe-torch,peft --layers 2

Two layer counts also give the time of one decoder layer (the difference of the step times): a 2-layer model's
step is mostly its LM head (151,936 x 2048), which both contenders compute alike; a real Qwen3-30B-A3B has 48
layers, so the per-layer time decides its training speed, and the table projects it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Made checkpoints go to the system's temporary folder unless --dir says otherwise: they are scratch, remade
# when missing, and a few GB each.
SCRATCH = Path(tempfile.gettempdir()) / "tiermoe-bench"

CONTENDERS = {
    "tiermoe-native": "tiermoe, native CPU tier (bf16, kernels)",
    "tiermoe-torch": "tiermoe, torch CPU tier (bf16)",
    "peft": "transformers + PEFT",
}

CHILD = r"""
import json, resource, sys, time, torch
from peft import LoraConfig
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
config = LoraConfig(r=args["rank"], lora_alpha=2 * args["rank"], target_modules="all-linear")
who = args["who"]
if who == "peft":
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.bfloat16), config)
else:
    from tiermoe.config import CPUConfig
    from tiermoe.model.loader import load_hybrid_model
    from tiermoe.training.lora import apply_lora
    backend = who.removeprefix("tiermoe-")
    hybrid = load_hybrid_model(args["model"], None, gpu_device="cpu", dtype=torch.bfloat16, progress=False,
                               cpu=CPUConfig(backend=backend, threads=args["threads"]), trainable=True)
    model = apply_lora(hybrid, config)
model.train()
loaded_rss = int(open("/proc/self/statm").read().split()[1]) * 4096
trainable = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trainable, lr=1e-4)
gen = torch.Generator().manual_seed(1)
vocab = model.config.vocab_size  # a PeftModel hands .config on from its base model
times, losses = [], []
for step in range(args["warmup"] + args["steps"]):
    ids = torch.randint(0, vocab, (args["batch"], args["tokens"]), generator=gen)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step >= args["warmup"]:
        times.append(time.perf_counter() - t0)
    losses.append(loss.item())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"step_s": times, "loss": losses, "peak_rss": peak, "loaded_rss": loaded_rss,
                  "trainable": sum(p.numel() for p in trainable)}))
"""


def run_child(who: str, model_dir: Path, args) -> dict:
    payload = dict(who=who, model=str(model_dir), threads=args.threads, rank=args.rank, tokens=args.tokens,
                   batch=args.batch, steps=args.steps, warmup=args.warmup)
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(payload)], check=True, stdout=subprocess.PIPE,
                         text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def checkpoint(preset: str, layers: int, root: Path) -> Path:
    out = root / f"{preset}-{layers}l"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tiermoe.cli.main", "make-model", "--arch", "qwen3_moe", "--preset",
                        preset, "--layers", str(layers), "--out", str(out)], check=True)
    return out


def median_step(runs: list[dict]) -> float:
    return statistics.median(t for run in runs for t in run["step_s"])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", default="2,4",
                        help="decoder layer counts (comma-separated); two or more also give the time per layer")
    parser.add_argument("--dir", type=Path, default=SCRATCH,
                        help="where checkpoints are (made with make-model when missing)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of all contenders")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--full-layers", type=int, default=48, help="layers of the real model, for the projection")
    parser.add_argument("--contenders", default="tiermoe-native,peft",
                        help=f"comma-separated, of: {', '.join(CONTENDERS)}")
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args(argv)
    who = [w.strip() for w in args.contenders.split(",") if w.strip()]
    unknown = [w for w in who if w not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {', '.join(CONTENDERS)}")
    layer_counts = sorted({int(n) for n in args.layers.split(",")})
    if not layer_counts or layer_counts[0] < 1:
        parser.error("--layers takes layer counts >= 1")
    dirs = {n: checkpoint(args.preset, n, args.dir) for n in layer_counts}

    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    results: dict[tuple[str, int], list[dict]] = {(w, n): [] for w in who for n in layer_counts}
    for r in range(args.rounds):
        for n in layer_counts:
            for w in who:
                print(f"round {r + 1}/{args.rounds}: {CONTENDERS[w]}, {n} layers ...", flush=True)
                results[(w, n)].append(run_child(w, dirs[n], args))
    tokens, gib = args.tokens * args.batch, 1024**3
    base = "peft" if "peft" in who else who[0]
    print(f"\n{args.preset}, {tokens} tokens per step, LoRA r={args.rank} all-linear, {args.threads} threads; "
          f"a step = forward + backward + AdamW")
    print(f"{'contender':42} {'layers':>6} {'tokens/s':>9} {'x ' + base:>9} {'peak RSS GiB':>13} {'after load':>11} "
          f"{'train params':>13}")
    for n in layer_counts:
        base_tps = tokens / median_step(results[(base, n)])
        for w in who:
            runs = results[(w, n)]
            tps = tokens / median_step(runs)
            print(f"{CONTENDERS[w]:42} {n:6} {tps:9.1f} {tps / base_tps:9.2f} "
                  f"{max(r['peak_rss'] for r in runs) / gib:13.2f} {max(r['loaded_rss'] for r in runs) / gib:11.2f} "
                  f"{runs[0]['trainable']:13,}")
    if len(layer_counts) > 1:
        lo, hi = layer_counts[0], layer_counts[-1]
        per_layer = {w: (median_step(results[(w, hi)]) - median_step(results[(w, lo)])) / (hi - lo) for w in who}
        print(f"\nper decoder layer (step time at {hi} layers - at {lo}, over {hi - lo}): the MoE layers without the "
              f"embedding and the {args.preset} LM head; projected to {args.full_layers} layers")
        print(f"{'contender':42} {'ms/layer':>9} {'x ' + base:>9} {args.full_layers:>6}-layer tokens/s")
        for w in who:
            fixed = median_step(results[(w, lo)]) - lo * per_layer[w]
            projected = tokens / (fixed + args.full_layers * per_layer[w])
            print(f"{CONTENDERS[w]:42} {1000 * per_layer[w]:9.0f} {per_layer[base] / per_layer[w]:9.2f} "
                  f"{projected:20.1f}")
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.json:
        raw = {f"{w}/{n}": runs for (w, n), runs in results.items()}
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": raw}))


if __name__ == "__main__":
    main()
