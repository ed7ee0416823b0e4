"""Server throughput and latency under concurrency, on one model, in one run.

1. one client, then 8 concurrent clients, each sending the same requests (alternated --repeats times, medians):
   total output tokens/s and the ratio (a decode step of 8 sequences is one batched forward that reads each
   expert's weights once for the whole batch, so the ratio should be >= 3);
2. while 4 streams decode, a long prompt arrives: the largest gap between their tokens, against the time one
   prefill chunk takes alone;
3. 32 concurrent clients for --soak-seconds, in two equal rounds: errors, tokens/s, and the server's memory (RSS)
   before, after each round and settled after the load (a leak shows as growth from round 1 to round 2; what
   the first round adds is the allocator keeping the pages of 32 sequences' KV caches).

    python benchmarks/bench_server.py                       # the bundled model
    python benchmarks/bench_server.py --model DIR --soak-seconds 60
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time

import httpx
import psutil

from tiermoe.bundled import resolve_model
from tiermoe.testing.server_process import ServerProcess


def complete(url: str, prompt: str, max_tokens: int) -> int:
    r = httpx.post(url + "/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


def throughput(url: str, clients: int, requests_each: int, max_tokens: int) -> float:
    done = [0] * clients

    def worker(i):
        for k in range(requests_each):
            done[i] += complete(url, f"Request {k} from client {i}: tell me about the sea.", max_tokens)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def stream_times(url: str, prompt: str, max_tokens: int, out: list[float]) -> None:
    with httpx.stream("POST", url + "/v1/completions", timeout=600, json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                out.append(time.perf_counter())


def prefill_gap(url: str, chunk: int, long_tokens: int) -> dict:
    """Largest token gap of running streams while a long prompt is prefilled, vs one chunk's prefill alone."""
    alone = []
    for _ in range(3):
        t = time.perf_counter()
        complete(url, "x " * chunk, 1)
        alone.append(time.perf_counter() - t)
    streams = [[] for _ in range(4)]
    threads = [threading.Thread(target=stream_times, args=(url, f"stream {i}", 120, s)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    while min(len(s) for s in streams) < 10:
        time.sleep(0.01)
    arrival = time.perf_counter()
    complete(url, "y " * long_tokens, 1)
    prefilled = time.perf_counter()
    for t in threads:
        t.join()
    gaps_during = [b - a for s in streams for a, b in itertools.pairwise(s) if a >= arrival - 0.5 and b <= prefilled + 0.5]
    gaps_before = [b - a for s in streams for a, b in itertools.pairwise(s) if b < arrival]
    return {"one_chunk_alone_s": min(alone), "median_gap_before_s": statistics.median(gaps_before),
            "max_gap_during_long_prefill_s": max(gaps_during), "long_prefill_s": prefilled - arrival}


def soak(url: str, proc: psutil.Process, clients: int, seconds: float) -> dict:
    """Two rounds of `clients` concurrent clients for seconds / 2 each, then 3 s idle; RSS after each."""
    rss_before = proc.memory_info().rss
    first = soak_round(url, clients, seconds / 2)
    rss_round1 = proc.memory_info().rss
    second = soak_round(url, clients, seconds / 2)
    rss_after = proc.memory_info().rss
    time.sleep(3)
    rss_settled = proc.memory_info().rss
    tokens = first["tokens"] + second["tokens"]
    return {"clients": clients, "seconds": seconds, "errors": first["errors"] + second["errors"],
            "tokens": tokens, "tokens_per_s": tokens / seconds,
            "rss_before_mb": rss_before / 1e6, "rss_round1_mb": rss_round1 / 1e6, "rss_after_mb": rss_after / 1e6,
            "rss_settled_mb": rss_settled / 1e6}


def soak_round(url: str, clients: int, seconds: float) -> dict:
    errors, tokens, stop = [0], [0], time.monotonic() + seconds
    lock = threading.Lock()

    def worker(i):
        while time.monotonic() < stop:
            try:
                # not `tokens[0] += complete(...)`: that reads tokens[0] before the request and writes it back
                # after, so the other threads' counts made meanwhile would be lost
                n, failed = complete(url, f"client {i} says hello", 16), 0
            except httpx.HTTPError:
                n, failed = 0, 1
            with lock:
                tokens[0] += n
                errors[0] += failed

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"errors": errors[0], "tokens": tokens[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests-each", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternated 1-client and 8-client measurements; the medians are reported")
    parser.add_argument("--chunk", type=int, default=128, help="--chunked-prefill-size of the server")
    parser.add_argument("--soak-seconds", type=float, default=60)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    model = resolve_model(args.model)
    print(f"starting a server on {model} ...", flush=True)
    server = ServerProcess(model, "--chunked-prefill-size", str(args.chunk), "--max-running-requests", "32")
    try:
        proc = psutil.Process(server.proc.pid)
        complete(server.url, "warm up", 4)
        ones, eights = [], []
        for r in range(args.repeats):  # alternated, so a burst of load from other jobs hits both sides alike
            print(f"1 client, then 8 clients ({r + 1}/{args.repeats}) ...", flush=True)
            ones.append(throughput(server.url, 1, args.requests_each * 2, args.max_tokens))
            eights.append(throughput(server.url, 8, args.requests_each, args.max_tokens))
        one, eight = statistics.median(ones), statistics.median(eights)
        print("long prompt arriving mid-stream ...", flush=True)
        gap = prefill_gap(server.url, args.chunk, 4 * args.chunk)
        print(f"{32} clients for {args.soak_seconds:.0f} s ...", flush=True)
        load = soak(server.url, proc, 32, args.soak_seconds)
    except Exception:
        print("server log (last lines):\n" + server.log_tail(), flush=True)
        raise
    finally:
        server.stop()

    print(f"\n{'measure':<68}{'value':>16}")
    rows = [
        (f"output tokens/s, 1 client (median of {args.repeats})", f"{one:.1f}"),
        (f"output tokens/s, 8 concurrent clients (median of {args.repeats})", f"{eight:.1f}"),
        ("ratio 8 clients / 1 client (goal >= 3)", f"{eight / one:.2f}x"),
        ("  ratio of each pair", " ".join(f"{e / o:.1f}" for o, e in zip(ones, eights))),
        ("one prefill chunk alone (s)", f"{gap['one_chunk_alone_s']:.3f}"),
        ("median token gap before the long prompt (s)", f"{gap['median_gap_before_s']:.3f}"),
        ("largest token gap while it is prefilled (s)", f"{gap['max_gap_during_long_prefill_s']:.3f}"),
        ("  = median gap + this many chunk times",
         f"{(gap['max_gap_during_long_prefill_s'] - gap['median_gap_before_s']) / gap['one_chunk_alone_s']:.2f}"),
        (f"soak: 32 clients x {load['seconds']:.0f} s, errors", str(load["errors"])),
        ("soak: tokens generated", str(load["tokens"])),
        ("soak: output tokens/s", f"{load['tokens_per_s']:.1f}"),
        ("server RSS before / after round 1 / after round 2 / settled (MB)",
         (f"{load['rss_before_mb']:.0f}/{load['rss_round1_mb']:.0f}/{load['rss_after_mb']:.0f}/"
          f"{load['rss_settled_mb']:.0f}")),
    ]
    for name, value in rows:
        print(f"{name:<68}{value:>16}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"one_client_tps": one, "eight_clients_tps": eight, "one_client_runs": ones,
                       "eight_clients_runs": eights, "gap": gap, "soak": load}, f, indent=2)


if __name__ == "__main__":
    main()
