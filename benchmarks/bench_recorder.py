"""What recording expert statistics costs in decode: the same model, the same prompts, recording on and off.

One LLM is loaded with a recorder. Recording is switched between decode steps (recorder.stop() makes the engine
and the blocks skip every recorder call: exactly the no-op path), alternating step by step and starting each run
with the other state, so drift and noise on a shared machine hit both alike. A run prefills a batch of random
prompts in one pass, then decodes `--decode-steps` passes; every decode step's wall time is attributed to the
state it ran in. The table gives the median step time off and on and their ratio (the issue asks for stat mode
to cost at most 5% of decode time), the median on/off ratio of neighbouring steps (robust to drift), and, as a
noise-free cross-check, the time of the recorder calls alone
(begin_pass, one record per MoE layer, end_pass on the same shapes) as a share of the median step.

    python benchmarks/bench_recorder.py                       # the bundled demo model
    python benchmarks/bench_recorder.py --model scratch/tiny-qwen3 --modes stat,per_pass,per_token
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tiermoe import LLM, SamplingParams
from tiermoe.arch import detect, load_config
from tiermoe.bundled import resolve_model
from tiermoe.stats.model_shape import ModelShape
from tiermoe.stats.recorders import make_recorder
from tiermoe.stats.recording import PassInfo


def alternating_run(llm, recorder, prompts: list[list[int]], steps: int, start_on: bool) -> list[tuple[bool, float]]:
    """One generate; recording flips after every decode step. Returns (recording?, ms) per decode step, in order."""
    steps_ms: list[tuple[bool, float]] = []
    state = {"on": start_on, "last": None}
    recorder.start() if start_on else recorder.stop()

    def on_step(produced) -> None:
        now = time.perf_counter()
        if state["last"] is not None:  # the first call ends the prefill pass: not a decode step
            steps_ms.append((state["on"], 1e3 * (now - state["last"])))
        state["on"] = not state["on"]
        recorder.start() if state["on"] else recorder.stop()
        state["last"] = time.perf_counter()

    llm.generate(prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True), on_step=on_step)
    return steps_ms


def paired_ratios(steps_ms: list[tuple[bool, float]]) -> list[float]:
    """on/off of each pair of neighbouring steps: drift slower than two steps cancels out."""
    ratios = []
    for (a_on, a), (b_on, b) in zip(steps_ms[0::2], steps_ms[1::2]):
        on, off = (a, b) if a_on else (b, a)
        ratios.append(on / off)
    return ratios


def recorder_call_us(recorder, shape: ModelShape, batch: int, device: str, repeats: int = 2000) -> float:
    """Microseconds per decode pass spent in the recorder itself: begin_pass, a record per MoE layer, end_pass."""
    info = PassInfo(tuple(range(batch)), (1,) * batch, (100,) * batch, (False,) * batch)
    ids_TK = torch.randint(0, shape.num_experts, (batch, shape.top_k), device=device)
    mask_E = torch.zeros(shape.num_experts, dtype=torch.bool, device=device)
    recorder.reset()
    recorder.start()
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(repeats):
            recorder.begin_pass(info)
            for layer in shape.moe_layers:
                recorder.record(layer, ids_TK, mask_E)
            recorder.end_pass()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--gpu-device", default="cpu")
    p.add_argument("--batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=40)
    p.add_argument("--runs", type=int, default=6, help="runs per mode (plus one warm-up run)")
    p.add_argument("--modes", default="stat", help="comma-separated recorder modes to compare with off")
    p.add_argument("--gpu-masks", action="store_true", help="also record GPU-tier snapshots")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = resolve_model(args.model)
    shape = ModelShape.of(detect(load_config(model_dir)))
    g = torch.Generator().manual_seed(0)
    rows = []
    for mode in args.modes.split(","):
        recorder = make_recorder(mode, shape, -1, args.gpu_masks)
        with LLM(model_dir, gpu_device=args.gpu_device, max_running=args.batch, recorder=recorder,
                 progress=False) as llm:
            vocab = llm.hybrid.config.vocab_size
            prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.batch)]
            alternating_run(llm, recorder, prompts, 4, True)  # warm-up
            times: dict[str, list[float]] = {"off": [], "on": []}
            pairs: list[float] = []
            for run in range(args.runs):
                steps_ms = alternating_run(llm, recorder, prompts, args.decode_steps, run % 2 == 0)
                for on, ms in steps_ms:
                    times["on" if on else "off"].append(ms)
                pairs += paired_ratios(steps_ms)
            calls_us = recorder_call_us(recorder, shape, args.batch, str(llm.hybrid.gpu_device))
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        rows.append((mode + (" + gpu masks" if args.gpu_masks else ""), off, on, statistics.median(pairs),
                     len(times["on"]), calls_us))

    print(f"model {model_dir} ({shape.model_type}: {len(shape.moe_layers)} MoE layers x {shape.num_experts} "
          f"experts, top-{shape.top_k}); device {args.gpu_device}; batch {args.batch}, prompts of "
          f"{args.prompt_tokens} tokens, {args.runs} runs x {args.decode_steps} decode steps alternating on/off; "
          f"torch threads {torch.get_num_threads()}")
    print("| mode | median step off (ms) | median step on (ms) | on/off (medians) | on/off (median of neighbour "
          "pairs) | steps each | recorder calls per step (us) | calls / step off |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, off, on, paired, n, calls_us in rows:
        print(f"| {mode} | {off:.3f} | {on:.3f} | {on / off:.3f} | {paired:.3f} | {n} | {calls_us:.1f} | "
              f"{100 * calls_us / 1e3 / off:.2f}% |")


if __name__ == "__main__":
    main()
