"""tiermoe against llama.cpp on the same checkpoint, CPU only, both sides at the same thread count, in one run.

For each model and format (the issue's: Qwen3-30B-A3B's shapes with 2 and 8 layers, in bf16 and 4-bit, where
tiermoe runs `--cpu-expert-dtype int4 --non-expert-dtype int4` (attention's k / v int8, its output, the LM head
and the experts' down projections int6, as Q4_K_M keeps more bits there) and llama.cpp the Q4_K_M file quantised
from the same bf16 GGUF; and 48 layers of tiny width, where a decode step is nearly all host time) each side runs in a process of its own (e2e/worker.py), and
the sides alternate within every round:
- decode: tokens/s of one sequence after a 16-token prompt (greedy; the prompt's step left out);
- time to first token of a 16-token prompt, and prefill of a 512-token prompt (tokens/s up to its first token);
- the bandwidth floor: bytes one decode token reads (weights + KV cache) over the read bandwidth probed in the same
  run by a STREAM-style read of 1 GiB on tiermoe's own kernel thread team, inside its worker process, after every
  round (csrc/probes.cpp; the best probe counts; where tiermoe has no team, torch.mv over 1 GiB in the parent);
  decode's share of it (the goal's figure), and beside it the share round by round at the rate probed in that
  round (the median of the rounds: the machine's read rate moves within a minute);
- tiermoe's batched decode: 8 sequences decoding together, each step's time against the least it must read (each
  weight once: non-expert weights and head, per MoE layer the union of the experts its rows route to, counted by
  a recorder, and the KV caches) at the probe's rate;
- tiermoe's time per part of a decode step (LM head, attention, MoE blocks, the rest; and inside the kernel
  library's calls against outside them, measured by wrapping the calls: the host's time) and its torch ops per
  layer; with --compare-commit REV the same for REV's tiermoe, alternating with this tree;
- held-out loss of each 4-bit form against its own bf16 model (GSM8K questions in the chat template, as
  bench_non_expert_quant.py scores them; random weights put every loss near log(vocab): the change from bf16 is
  what compares).
Then the tables, with ratios against llama.cpp and the issue's goals, reached or not.

llama.cpp is llama-cpp-python 0.3.36 (e2e/llama_cpp.py: the wheel is built once, about 15 minutes on 2 cores, and
cached), on its default path (weights repacked at load for its fastest CPU kernels); where that path fails on a
machine, the same file runs without repacking from then on, and the tables say so ("without its weight
repacking"). Without llama-cpp-python the llama.cpp side is skipped with a one-line message and tiermoe's side
still runs. Models and GGUF files are made on the first run and kept (e2e/models.py); timing figures from a
loaded machine are not results (the load average is printed before and after).

    python benchmarks/bench_e2e_cpu.py --build-llama-cpp --quick          # build llama.cpp, a short first run
    python benchmarks/bench_e2e_cpu.py --rounds 5 --json e2e.json         # the issue's models, 5 alternating rounds
    python benchmarks/bench_e2e_cpu.py --models tiny-48l --compare-commit HEAD~1 --rounds 5
    python benchmarks/bench_e2e_cpu.py --models gpt-oss-tiny-24l,gpt-oss-20b-2l --rounds 5 --loss-prompts 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_experts import MachineProbe  # noqa: E402
from e2e import llama_cpp as llama  # noqa: E402
from e2e.models import DEFAULT_MODELS, MODELS, dir_bytes, prepare  # noqa: E402
from e2e.report import LLAMA, NO_REPACK, TIERMOE, evaluate_goals, keep_round, report  # noqa: E402
from e2e.side_process import SideError, Worker  # noqa: E402
from support.decode_rounds import print_load_average  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT, PREFILL = 16, 512
BATCH = 8  # sequences decoding together (the batched figure)
PROBES = 5  # read-bandwidth probes per round (torch.mv over 1 GiB, about 50 ms each)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help=f"comma-separated, of: {', '.join(MODELS)} (default: "
                   f"{','.join(DEFAULT_MODELS)}; --quick: qwen3-30b-a3b-2l,tiny-48l)")
    p.add_argument("--formats", default="bf16,4-bit", help="bf16 and/or 4-bit (default both; tiny-48l is bf16 only)")
    p.add_argument("--threads", type=int, default=2, help="threads of each side (default 2)")
    p.add_argument("--tiermoe-threads", default=None, metavar="N|default",
                   help="tiermoe's --cpu-threads and torch threads if not --threads; 'default': tiermoe's own choice")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the median counts, the spread is shown "
                                                  "(default 3)")
    p.add_argument("--tokens", type=int, default=64, help="decode steps timed per round (default 64)")
    p.add_argument("--component-steps", type=int, default=16, help="decode steps timed by part (default 16)")
    p.add_argument("--loss-prompts", type=int, default=32, help="held-out prompts scored (default 32; 0: no loss)")
    p.add_argument("--loss-max-tokens", type=int, default=256, help="tokens per held-out prompt at most")
    p.add_argument("--quick", action="store_true",
                   help="a short run: 1 round, 16 tokens, 4 steps by part, 4 held-out prompts of 64 tokens")
    p.add_argument("--compare-commit", metavar="REV",
                   help="also run tiermoe of commit REV (its files by git archive, on PYTHONPATH), alternating with "
                        "this tree")
    p.add_argument("--no-llama-cpp", action="store_true", help="tiermoe's side only")
    p.add_argument("--build-llama-cpp", action="store_true",
                   help=f"build llama-cpp-python {llama.LLAMA_CPP_VERSION} into {llama.wheels_dir()} unless cached, "
                        "and install it (about 15 minutes on 2 cores)")
    p.add_argument("--reload", choices=("auto", "yes", "no"), default="auto",
                   help="load each side anew every round (auto: when the sides would not fit in memory together)")
    p.add_argument("--work-dir", type=Path, default=llama.cache_dir() / "bench-e2e",
                   help="where the models and GGUF files are made and kept (default ~/.cache/tiermoe/bench-e2e)")
    p.add_argument("--json", type=Path, help="also write every figure and goal here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.tokens, args.component_steps = 1, 16, 4
        args.loss_prompts, args.loss_max_tokens = min(args.loss_prompts, 4), min(args.loss_max_tokens, 64)
    names = (args.models or ("qwen3-30b-a3b-2l,tiny-48l" if args.quick else ",".join(DEFAULT_MODELS))).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    args.models = [MODELS[n] for n in names]
    args.formats = args.formats.split(",")
    t = args.tiermoe_threads
    args.tiermoe_threads = args.threads if t is None else None if t == "default" else int(t)
    if set(args.formats) - {"bf16", "4-bit"}:
        p.error("--formats takes bf16 and/or 4-bit")
    return args


def compare_tree(rev: str, work: Path) -> tuple[str, Path]:
    """(short sha, REV's files unpacked under the work directory by `git archive`), made once; the repository's
    own state (worktrees, index) is left alone."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True,
                         text=True)
    if sha.returncode != 0:
        raise SystemExit(f"--compare-commit {rev}: not a commit of {REPO}")
    short = sha.stdout.strip()[:10]
    tree = work / f"tree-{short}"
    if not (tree / "tiermoe").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.Popen(["git", "-C", str(REPO), "archive", short], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tree)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"--compare-commit {rev}: git archive failed")
    print(f"[compare] tiermoe@{short}: {tree}", flush=True)
    return short, tree


def random_prompt(rng: random.Random, vocab: int, n: int) -> list[int]:
    """n ordinary token ids, different every call (no side reuses a cached prefix)."""
    return [rng.randrange(10, min(vocab, 150000)) for _ in range(n)]


def one_round(worker: Worker, figures: dict, team_rates: list[float], round_rates: list, rng: random.Random,
              vocab: int, args) -> None:
    """One side's round into `figures`; on tiermoe's side (this tree's) also the read probe on its team (into
    `team_rates`, and this round's into `round_rates`: None where it has no team) and BATCH sequences decoding
    together with what their step reads at least (figures["batched_rounds"]), on the same load of the model."""
    keep_round(figures, measure_round(worker, rng, vocab, args.tokens))
    if worker.label != TIERMOE:
        return
    rate = worker.call("read_rate")
    team_rates.extend([rate] if rate else [])
    round_rates.append(rate)
    prompts = [random_prompt(rng, vocab, PROMPT) for _ in range(BATCH)]
    figures.setdefault("batched_rounds", []).append(
        worker.call("batched_decode", prompts=prompts, tokens=max(4, args.tokens // 4)))


def without_repacking(side: tuple) -> tuple | None:
    """The llama.cpp side `side` (label, backend, load args, ...) loading the same file without llama.cpp's weight
    repacking, or None where that is not a fallback: another backend, or repacking off already. llama.cpp's repack
    path is its fastest on a CPU that has it, and the one that can fail (SIGILL in its AMX repacking on a 2-core Xeon
    VM); without it the same file runs its plain CPU kernels, and the tables say so, never a silent drop."""
    label, backend, load, *rest = side
    if backend != "llama.cpp" or load.get("repack") is False:
        return None
    return (label, backend, {**load, "repack": False}, *rest)


def measure_round(worker: Worker, rng: random.Random, vocab: int, tokens: int) -> dict:
    decode = worker.call("decode_s_per_token", prompt=random_prompt(rng, vocab, PROMPT), tokens=tokens)
    ttft = worker.call("first_token_s", prompt=random_prompt(rng, vocab, PROMPT))
    prefill = worker.call("first_token_s", prompt=random_prompt(rng, vocab, PREFILL))
    return {"decode_tok_s": 1 / decode, "ttft16_s": ttft, "prefill512_tok_s": PREFILL / prefill}


LOAD_PEAK = 1.3  # tiermoe's peak while loading, over the bf16 checkpoint's bytes (8 layers: 14.3 GB for 11.2)


def sides_for(model, fmt: str, files: dict, args, compare) -> list[tuple[str, str, dict, Path | None, int, int]]:
    """(label, backend, load args, PYTHONPATH, bytes it holds, bytes at its loading peak) of each side of a row."""
    checkpoint = dir_bytes(files["hf"])
    held, peak = int(checkpoint * (4 / 16 if fmt == "4-bit" else 1.0)), int(checkpoint * LOAD_PEAK)
    sides = [(TIERMOE, "tiermoe", dict(path=str(files["hf"]), threads=args.tiermoe_threads, quant=fmt), REPO, held,
              peak)]
    if compare is not None:
        sides.append((f"tiermoe@{compare[0]}", "tiermoe", sides[0][2], compare[1], held, peak))
    if args.llama:
        context = PREFILL + args.tokens + PROMPT + 16
        size = dir_bytes(files[fmt])
        sides.append((LLAMA, "llama.cpp", dict(path=str(files[fmt]), threads=args.threads, context=context), None,
                      size, size))
    return sides


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def run_row(model, fmt: str, files: dict, args, compare, probe: MachineProbe, team_rates: list[float],
            rng: random.Random) -> dict:
    """One model and format: every side, alternating, --rounds rounds; tiermoe's team read probe goes to
    `team_rates` after each of its rounds."""
    tag = f"[{model.name} {fmt}]"
    available = available_bytes()
    sides = []
    for side in sides_for(model, fmt, files, args, compare):
        if side[5] > 0.95 * available:  # it would be killed for memory while loading, or take the machine with it
            print(f"{tag} {side[0]} skipped: loading it takes about {side[5] / 1e9:.1f} GB, "
                  f"{available / 1e9:.1f} GB are available", flush=True)
        else:
            sides.append(side)
    reload = args.reload == "yes" or (args.reload == "auto" and sum(s[4] for s in sides) > 0.75 * available)
    if reload:
        print(f"{tag} the sides do not fit in memory together: each loads anew every round", flush=True)
    vocab = json.loads((files["hf"] / "config.json").read_text())["vocab_size"]
    workers: dict[str, Worker] = {}
    best: dict[str, dict] = {s[0]: {} for s in sides}  # per side: the medians of the rounds so far
    layers, round_rates = [], []  # round_rates: tiermoe's team probe of each round, for the paired floor share

    def on_side(side, task) -> None:
        """task(worker) on this side's worker (loaded and warmed up first if need be); a side that fails is
        dropped from the row, with its error, and the others go on."""
        try:
            if side[0] not in workers:
                print(f"{tag} loading {side[0]}", flush=True)
                w = workers[side[0]] = Worker(side[0], side[1], side[2], side[3])
                w.call("decode_s_per_token", prompt=random_prompt(rng, vocab, PROMPT), tokens=4)  # warm-up
                w.call("first_token_s", prompt=random_prompt(rng, vocab, PREFILL))
            layers.append(workers[side[0]].layers)
            task(workers[side[0]])
        except SideError as err:
            fallback = without_repacking(side)
            if side[0] in workers:
                workers.pop(side[0]).close()
            if fallback is not None:
                print(f"{tag} {side[0]} failed ({err}); running the same file without its weight repacking from "
                      "here on, its earlier rounds dropped (labelled in the tables)", flush=True)
                sides[sides.index(side)] = fallback
                best[side[0]] = {"path": NO_REPACK}
                on_side(fallback, task)
                return
            print(f"{tag} {side[0]} dropped: {err}", flush=True)
            sides.remove(side)
            best.pop(side[0])
            reload_now = True
        else:
            reload_now = reload
        if reload_now and side[0] in workers:
            workers.pop(side[0]).close()

    def parts(label: str, w: Worker) -> None:
        print(f"{tag} {label}: time per part of a decode step, torch ops", flush=True)
        prompt = random_prompt(rng, vocab, PROMPT)
        best[label]["components_ms"] = w.call("components_ms", prompt=prompt, steps=args.component_steps)
        best[label]["ops_per_layer"] = w.call("ops_per_layer", prompt=random_prompt(rng, vocab, PROMPT))
        best[label]["bytes_per_token"] = w.call("bytes_per_token", context=context)

    context = PROMPT + args.tokens / 2
    try:
        for r in range(args.rounds):
            for _ in range(PROBES):  # the floor is the machine's best read rate, not one unlucky sample
                probe.probe(args.threads)
            for side in list(sides):
                on_side(side, lambda w: one_round(w, best[w.label], team_rates, round_rates, rng, vocab, args))
            print(f"{tag} round {r + 1}/{args.rounds} (medians so far): " + "; ".join(
                f"{label} {b['decode_tok_s']:.1f} tok/s, TTFT16 {b['ttft16_s'] * 1e3:.0f} ms, "
                f"prefill512 {b['prefill512_tok_s']:.0f} tok/s" for label, b in best.items()), flush=True)
        for side in list(sides):
            if side[1] == "tiermoe":
                on_side(side, lambda w: parts(w.label, w))
            else:
                best[side[0]]["bytes_per_token"] = llama.gguf_bytes_per_token(files[fmt], context)
    finally:
        for w in workers.values():
            w.close()
    if not best:
        raise SideError("no side ran")
    return {"model": model.name, "format": fmt, "layers": layers[0], "host_bound": model.host_bound,
            "round_read_rates": round_rates, "backends": best}


def run_loss(model, files: dict, args) -> dict:
    """Held-out loss of tiermoe bf16 / 4-bit and llama.cpp bf16 / Q4_K_M, one side loaded at a time."""
    print(f"[{model.name}] held-out loss: {args.loss_prompts} GSM8K prompts", flush=True)
    config = json.loads((files["hf"] / "config.json").read_text())
    out = {"model": model.name, "vocab": config["vocab_size"]}
    rows = None
    sides = [("tiermoe bf16", "tiermoe", dict(path=str(files["hf"]), threads=args.tiermoe_threads, quant="bf16")),
             ("tiermoe 4-bit", "tiermoe", dict(path=str(files["hf"]), threads=args.tiermoe_threads, quant="4-bit"))]
    if args.llama:
        context = PREFILL + 16
        sides += [("llama.cpp bf16", "llama.cpp", dict(path=str(files["bf16"]), threads=args.threads, context=context)),
                  ("llama.cpp Q4_K_M", "llama.cpp",
                   dict(path=str(files["4-bit"]), threads=args.threads, context=context))]
    peak, available = dir_bytes(files["hf"]) * LOAD_PEAK, available_bytes()
    if peak > 0.95 * available:
        raise SideError(f"loading tiermoe takes about {peak / 1e9:.1f} GB, {available / 1e9:.1f} GB are available")
    for label, backend, load in sides:
        start = time.perf_counter()
        w = Worker(label, backend, load, REPO if backend == "tiermoe" else None)
        try:
            if rows is None:
                rows = w.call("held_out_rows", num=args.loss_prompts, max_tokens=args.loss_max_tokens)
                out["tokens"] = sum(len(r) - 1 for r in rows)
            out[label] = w.call("loss", rows=rows)
        finally:
            w.close()
        print(f"  {label}: {out[label]:.4f} nats ({time.perf_counter() - start:.0f} s)", flush=True)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    print_load_average("before")
    if args.build_llama_cpp:
        llama.build_and_install()
    args.llama = not args.no_llama_cpp and llama.llama_cpp_installed()
    if not args.no_llama_cpp and not args.llama:
        print(llama.missing_message(), flush=True)
    compare = compare_tree(args.compare_commit, args.work_dir) if args.compare_commit else None
    probe, team_rates = MachineProbe([args.threads]), []
    rng = random.Random(0)
    results = {"machine": {"threads": args.threads, "tiermoe_threads": args.tiermoe_threads, "cpus": os.cpu_count(),
                           "load_before": os.getloadavg()},
               "rows": [], "loss": []}
    for model in args.models:
        formats = [f for f in args.formats if f in model.formats]
        if not formats:
            continue
        files = prepare(model, args.work_dir, formats, args.llama, args.threads)
        for fmt in formats:
            try:
                results["rows"].append(run_row(model, fmt, files, args, compare, probe, team_rates, rng))
            except SideError as err:
                print(f"[{model.name} {fmt}] skipped: {err}", flush=True)
        if model.loss and args.loss_prompts > 0 and set(formats) == {"bf16", "4-bit"}:
            try:
                results["loss"].append(run_loss(model, files, args))
            except SideError as err:
                print(f"[{model.name}] loss skipped: {err}", flush=True)
    torch_mv = probe.limits[args.threads][0]
    results["machine"].update(read_bandwidth=max(team_rates, default=torch_mv), torch_mv_bandwidth=torch_mv,
                              read_probe="tiermoe's team" if team_rates else "torch.mv", load_after=os.getloadavg())
    print_load_average("after")
    print(f"\nread bandwidth, the floor's: {results['machine']['read_bandwidth'] / 1e9:.1f} GB/s (best "
          f"{results['machine']['read_probe']} probe, {len(team_rates)} probes of tiermoe's team; torch.mv at "
          f"{args.threads} threads in the parent: {torch_mv / 1e9:.1f} GB/s)\n")
    print(report(results))
    if args.json:
        results["goals"] = [vars(g) for g in evaluate_goals(results)]
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
