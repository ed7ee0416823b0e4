"""Serving under hostile load (issue 54): do well-behaved streaming clients keep their pace while others attack?

One server (`tiermoe serve`, a subprocess, loopback only) runs a `make-model --preset qwen3-30b-a3b` checkpoint with
Qwen's real tokenizer, shrunk to hidden size 128 and one layer, with --max-request-bytes 1 MiB and
--max-total-tokens 65536 (the 8k-token generation needs more KV cache than the default 8192). Each run:
1. alone: --clients well-behaved clients (soak/clients.py) stream greedy requests over the four generation
   endpoints for --phase-seconds; a third of their requests are malformed (soak/requests.py's bad kinds), each due
   a 4xx;
2. under attack: the same clients again, while another process (soak/adversaries.py) holds --idle idle and --slow
   slow-body connections, streams one 8k-token generation whose two stop strings never match, scores a 4k-token
   prompt (echo, logprobs 5, max_tokens 1) and sends --batches /generate batches of --batch-size prompts at once
   (a 503 with Retry-After is a correct answer to those, counted apart);
3. once every client has gone, SIGTERM: the seconds until the server exits, and its exit status.
/health is polled every second throughout; the server's RSS and open descriptors (/proc/PID/fd) are sampled.

The table gives each figure's median over --runs runs, its min-max and its goal: no well-behaved request fails (a
stream that does not end whole, a malformed request answered other than 4xx), p99 inter-token latency under attack
within 2x of alone and p99 time to first token within 3x, /health never fails, SIGTERM exits 0 within 10 s. Exit
status 1 when a median misses its goal. The adversaries' process raises its soft open-file limit to the hard one
(so does the server, and this process when --clients needs it); every wait has a deadline, and options that could
take more than 20 minutes in all are refused.

    python benchmarks/soak_adversarial.py                              # 3 runs of 2 x 60 s: about 8 minutes
    python benchmarks/soak_adversarial.py --runs 1 --phase-seconds 30  # one short run: about 2 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import queue
import resource
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
from soak.adversaries import Plan, run_adversaries
from soak.clients import REQUEST_S, PhaseTally, Watch, good_phase, poll, warm_up
from soak.figures import print_table
from soak.requests import bad_kinds, good_pool
from support.rss_sampler import RssSampler

from tiermoe.config import open_files_limit, raise_open_files_limit
from tiermoe.testing.make_model import make_model
from tiermoe.testing.server_process import ServerProcess

MAX_REQUEST_BYTES = 1 << 20  # the bad kind "body over --max-request-bytes" then sends 2 MiB, not 16
# The 8k-token generation alone needs more KV cache than the default 8192 tokens; 64k tokens of this model's one
# layer are 128 MiB.
MAX_TOTAL_TOKENS = 65536
DISTINCT = 12  # distinct good streamed requests
# Deadlines, in seconds: together with REQUEST_S (a request, and the drain after a phase) they bound a run.
SETUP_S = 30  # writing the checkpoint, once
START_S = 60  # the server answers /health
WARM_S = 30  # each distinct good request once (a few seconds here)
SPAWN_S = 15  # the adversaries' process starts (it imports what this script imports)
RAMP_S = 20  # then opens its connections
ADVERSARIES_STOP_S = 15
SIGTERM_WAIT_S = 30  # ServerProcess.stop kills the server after this long
TOTAL_LIMIT_S = 20 * 60
SPARE_FILES = 256  # descriptors beyond the sockets: the interpreter, torch, the model files


def run_bound(phase_s: float) -> float:
    return START_S + WARM_S + 2 * (phase_s + REQUEST_S) + SPAWN_S + RAMP_S + ADVERSARIES_STOP_S + SIGTERM_WAIT_S


async def under_attack(args, url: str, pool: list, bad: list, watch: Watch) -> tuple[PhaseTally, dict]:
    """The adversaries' process ramps up, then the clients' phase runs beside it; its counts once it has stopped."""
    ctx = multiprocessing.get_context("spawn")  # not fork: this process has threads (the samplers, the log reader)
    ready, stop, results = ctx.Event(), ctx.Event(), ctx.Queue()
    plan = Plan(url, idle=args.idle, slow=args.slow, long_tokens=args.long_tokens, score_words=args.score_tokens,
                batches=args.batches, batch_size=args.batch_size, batch_tokens=args.batch_tokens, ramp_s=RAMP_S)
    process = ctx.Process(target=run_adversaries, args=(plan, ready, stop, results), name="adversaries")
    process.start()
    try:
        await asyncio.to_thread(ready.wait, SPAWN_S + RAMP_S)
        tally = await good_phase("under attack", args.clients, args.phase_seconds, url, pool, bad, watch)
    finally:
        stop.set()
        adversaries = await asyncio.to_thread(_results, results, process)
    return tally, adversaries


def _results(results, process) -> dict:
    try:
        counts = results.get(timeout=ADVERSARIES_STOP_S)
    except queue.Empty:  # the process died or hung: the figures say so
        counts = {"adversaries' process gave no counts": 1}
    process.join(5)
    if process.is_alive():
        process.kill()
    return counts

async def measure(args, url: str, proc: psutil.Process, pool: list, bad: list) -> tuple:
    await asyncio.wait_for(warm_up(url, pool), WARM_S)
    watch = Watch(proc)
    poller = asyncio.create_task(poll(url, watch))
    try:
        alone = await good_phase("alone", args.clients, args.phase_seconds, url, pool, bad, watch)
        attack, adversaries = await under_attack(args, url, pool, bad, watch)
    finally:
        poller.cancel()
    return alone, attack, adversaries, watch


def one_run(args, model: Path, k: int) -> dict[str, float]:
    print(f"run {k + 1}/{args.runs}: starting the server ...", file=sys.stderr, flush=True)
    load = os.getloadavg()[0]  # other work on the machine shows here: the phases share its cores with it
    server = ServerProcess(model, "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-total-tokens",
                           str(MAX_TOTAL_TOKENS), *shlex.split(args.server_args), timeout=START_S)
    try:
        proc = psutil.Process(server.proc.pid)
        context = httpx.get(server.url + "/v1/models", timeout=WARM_S).json()["data"][0]["max_model_len"]
        bad = [(kind.name, path, kind.payload(path)) for kind in bad_kinds(MAX_REQUEST_BYTES, context)
               for path in kind.paths]
        pool = [request for request in good_pool(2 * DISTINCT) if request.stream]
        files_limit = proc.rlimit(psutil.RLIMIT_NOFILE)[0]
        sampler = RssSampler(proc, interval=0.5).start()
        try:
            alone, attack, adversaries, watch = asyncio.run(measure(args, server.url, proc, pool, bad))
        finally:
            sampler.stop()  # before SIGTERM: the sampler reads the process's children
        started = time.monotonic()
        status = server.stop(signal.SIGTERM)
        exit_s = time.monotonic() - started
    except Exception:
        print("server log (last lines):\n" + server.log_tail(), file=sys.stderr, flush=True)
        server.stop()
        raise
    show_details(k, alone, attack, adversaries, server.log_tail())
    out = figures(alone, attack, watch, sampler) | adversary_figures(adversaries, args.batches)
    return out | {"files limit": files_limit, "sigterm s": exit_s, "exit status": status, "load": load}


def show_details(k: int, alone: PhaseTally, attack: PhaseTally, adversaries: dict, log: str) -> None:
    """The first failures of each phase, the adversaries' counts, and the server's word on its open-file limit."""
    for name, tally in (("alone", alone), ("under attack", attack)):
        for why in tally.examples:
            print(f"run {k + 1}, {name}, FAILED: {why}")
    shown = ", ".join(f"{key}: {value:.4g}" for key, value in sorted(adversaries.items()))
    print(f"run {k + 1}, adversaries' counts: {shown}")
    raised = [line.strip() for line in log.splitlines() if "open-file limit (ulimit -n) raised" in line]
    print(f"run {k + 1}, server: {raised[0] if raised else 'its open-file limit was already at the hard one'}")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def figures(alone: PhaseTally, attack: PhaseTally, watch: Watch, sampler: RssSampler) -> dict[str, float]:
    out = {}
    for name, phase, tally in (("alone", "alone", alone), ("attack", "under attack", attack)):
        start, end = watch.windows[phase]
        server_cpu, clients_cpu = watch.cpu[phase]
        out |= {f"streams {name}": tally.streams, f"failed {name}": sum(tally.failures.values()),
                f"malformed {name}": sum(tally.malformed.values()),
                f"malformed 4xx {name}": sum(n for what, n in tally.malformed.items() if what.startswith("4")),
                f"ttft p50 {name}": percentile(tally.ttft, 50), f"ttft p99 {name}": percentile(tally.ttft, 99),
                f"itl p50 {name}": 1000 * percentile(tally.itl, 50),
                f"itl p99 {name}": 1000 * percentile(tally.itl, 99),
                f"rss {name}": max((rss for t, rss in sampler.samples if start <= t <= end), default=0) / 1e6,
                f"fds {name}": max((s[3] for s in watch.during(phase)), default=0),
                f"server cores {name}": server_cpu / (end - start),
                f"clients cores {name}": clients_cpu / (end - start)}
    return out | {"ttft ratio": out["ttft p99 attack"] / out["ttft p99 alone"],
                  "itl ratio": out["itl p99 attack"] / out["itl p99 alone"],
                  "health polls": len(watch.samples), "health failed": sum(1 for s in watch.samples if not s[1]),
                  "health slowest": max((s[2] for s in watch.samples), default=float("nan"))}


def adversary_figures(adversaries: dict, batches: int) -> dict[str, float]:
    """The adversaries' counts, and their batches answered other than 200 or 503 with Retry-After (an error, a
    503 without it, another status) or cut unanswered when the attack ended."""
    answered = {key: n for key, n in adversaries.items() if key.startswith("batch ")}
    correct = answered.get("batch 200", 0) + answered.get("batch 503 retry", 0)
    return {**{f"adv {key}": float(value) for key, value in adversaries.items()},
            "batch other": sum(answered.values()) - correct, "batch cut": batches - sum(answered.values())}


def checkpoint(args, tmp: str) -> Path:
    if args.model:
        return Path(args.model)
    print("writing a qwen3-30b-a3b checkpoint shrunk to hidden size 128, 1 layer, with its tokenizer ...",
          file=sys.stderr, flush=True)
    return make_model("qwen3_moe", Path(tmp) / "qwen3-30b-a3b-h128-1l", preset="qwen3-30b-a3b", layers=1,
                      config_overrides={"hidden_size": 128}, tokenizer=True, progress=False)


EXAMPLES = """examples:
  python benchmarks/soak_adversarial.py                              # 3 runs, the defaults: about 8 minutes
  python benchmarks/soak_adversarial.py --runs 1 --phase-seconds 30  # one short run: about 2 minutes
  python benchmarks/soak_adversarial.py --idle 500 --slow 50 --clients 16
  python benchmarks/soak_adversarial.py --runs 1 --server-args '--max-running-requests 64 --body-timeout 10'
  # which adversary costs what: one kind of request at a time, beside the connections
  python benchmarks/soak_adversarial.py --runs 1 --batches 0 --long-tokens 0          # the scoring request
  python benchmarks/soak_adversarial.py --runs 1 --score-tokens 0 --long-tokens 0     # the batches
"""


def parse_args(argv=None):
    description = __doc__.split("\n\n    python")[0]  # the examples are the epilog's
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EXAMPLES)
    parser.add_argument("--runs", type=int, default=3, help="whole runs (a fresh server each); medians (default 3)")
    parser.add_argument("--phase-seconds", type=float, default=60, help="length of each phase (default 60)")
    parser.add_argument("--clients", type=int, default=32, help="well-behaved streaming clients (default 32)")
    parser.add_argument("--idle", type=int, default=2000, help="idle connections held (default 2000)")
    parser.add_argument("--slow", type=int, default=170, help="slow-body connections held (default 170)")
    parser.add_argument("--batches", type=int, default=10, help="/generate batches sent at once (default 10)")
    parser.add_argument("--batch-size", type=int, default=80, help="prompts per batch (default 80)")
    parser.add_argument("--batch-tokens", type=int, default=64, help="max_new_tokens of a batch (default 64)")
    parser.add_argument("--long-tokens", type=int, default=8192,
                        help="the long generation's tokens (default 8192; 0: none)")
    parser.add_argument("--score-tokens", type=int, default=4096,
                        help="the scored prompt's tokens (default 4096; 0: no scoring request)")
    parser.add_argument("--model", help="checkpoint directory (default: write the shrunk Qwen3-30B-A3B)")
    parser.add_argument("--server-args", default="", help="more `tiermoe serve` flags, one string")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args) -> None:
    at_least_one = ("runs", "clients", "batch_size", "batch_tokens")
    at_least_zero = ("idle", "slow", "batches", "long_tokens", "score_tokens")
    if any(getattr(args, name) < 1 for name in at_least_one) or any(getattr(args, n) < 0 for n in at_least_zero):
        parser.error("expected --runs, --clients, --batch-size and --batch-tokens >= 1; --idle, --slow, --batches, "
                     "--long-tokens and --score-tokens >= 0")
    if args.long_tokens + 16 > MAX_TOTAL_TOKENS or args.score_tokens + 16 > MAX_TOTAL_TOKENS:
        parser.error(f"--long-tokens and --score-tokens must leave room in the server's KV cache of "
                     f"{MAX_TOTAL_TOKENS} tokens (--max-total-tokens)")
    if not 1 <= args.phase_seconds:
        parser.error(f"--phase-seconds must be at least 1, got {args.phase_seconds:g}")
    total = SETUP_S + args.runs * run_bound(args.phase_seconds)
    if total > TOTAL_LIMIT_S:
        parser.error(f"--runs {args.runs} x --phase-seconds {args.phase_seconds:g} could take {total / 60:.1f} "
                     f"minutes (each run at most {run_bound(args.phase_seconds):.0f} s: 2 phases and "
                     f"{run_bound(0):.0f} s of start, ramp, drains and SIGTERM); the limit is "
                     f"{TOTAL_LIMIT_S // 60} minutes in all: lower --runs or --phase-seconds")
    needed = args.idle + args.slow + args.clients + args.batches + SPARE_FILES
    if needed > open_files_hard_limit():
        parser.error(f"{needed} descriptors needed ({args.idle} idle + {args.slow} slow connections + ...), but the "
                     f"hard open-file limit is {open_files_hard_limit()} (ulimit -Hn): lower --idle or --slow")


def open_files_hard_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 2**31 if hard == resource.RLIM_INFINITY else hard


def main(argv=None) -> int:
    args = parse_args(argv)
    about = args.runs * (2 * args.phase_seconds + 40)
    print(f"{args.runs} run(s) of 2 x {args.phase_seconds:g} s: about {about / 60:.0f} minutes, at most "
          f"{(SETUP_S + args.runs * run_bound(args.phase_seconds)) / 60:.0f}", file=sys.stderr, flush=True)
    if args.clients + SPARE_FILES > open_files_limit():  # the adversaries' process raises its own
        raise_open_files_limit()
    with tempfile.TemporaryDirectory() as tmp:
        model = checkpoint(args, tmp)
        runs = [one_run(args, model, k) for k in range(args.runs)]
    missed = print_table(runs, f"adversarial soak: {args.runs} run(s), {args.clients} clients, 2 x "
                               f"{args.phase_seconds:g} s; {args.idle} idle + {args.slow} slow-body connections, "
                               f"{args.batches} batches of {args.batch_size}; medians over the runs")
    for label in missed:
        print(f"MISSED: {label}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
