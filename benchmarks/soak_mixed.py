"""A soak with good and bad requests mixed: one bad request must never hurt another (issue 19).

The server runs the bundled model in fp32 (so batching cannot flip a greedy tie) with --max-request-bytes 1 MiB.
Each distinct good request (greedy; every endpoint, streamed and not) is first run alone for its reference. Then
--clients threads send requests for --seconds, a third of them bad ones (soak/requests.py: invalid JSON, wrong
types, out-of-range values, a token id outside the vocabulary, prompts and max_tokens beyond the context, a lone
surrogate, JSON nested 10000 deep, a 5000-digit integer, a body over the limit, clients leaving mid-stream, ...).

It passes when every good request gives exactly its reference (text, token count, finish reason), every bad one
gets a 4xx (no 5xx, no error, no timeout), no request is left running afterwards, and the server's RSS levels off:
growth over the second half of the soak at most max(LEVEL_RATIO x the first half's, LEVEL_FLOOR_MB).
Exit status 1 when a criterion fails.

    python benchmarks/soak_mixed.py                             # 32 clients, 60 s, the bundled model
    python benchmarks/soak_mixed.py --seconds 20 --clients 12   # a quick look
    python benchmarks/soak_mixed.py --seconds 600 --plot soak_rss.png
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
from bench_server import complete
from soak.requests import (
    DISCONNECT,
    ENDPOINTS,
    GoodRequest,
    Refused,
    Reply,
    bad_kinds,
    good_pool,
    leave_mid_stream,
    send_bad,
    send_good,
)
from support.fp32_checkpoint import fp32_view
from support.rss_sampler import RssSampler, tree_rss

from tiermoe.bundled import resolve_model
from tiermoe.testing.server_process import ServerProcess

MAX_REQUEST_BYTES = 1 << 20
LEVEL_RATIO, LEVEL_FLOOR_MB = 0.25, 16
SETTLE_S = 5


class Tally:
    """What the clients saw, counted under one lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.good = collections.Counter()  # exact / mismatch / a failure's status or error
        self.tokens = 0
        self.mismatches: list[tuple[GoodRequest, Reply, Reply]] = []
        self.failures: list[tuple[GoodRequest, str]] = []
        self.bad: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def good_sent(self) -> int:
        return sum(self.good.values())

    def bad_statuses(self) -> collections.Counter:
        total = collections.Counter()
        for kind, statuses in self.bad.items():
            if kind != DISCONNECT:
                total.update(statuses)
        return total


def outcome(err: Exception) -> str:
    if isinstance(err, Refused) and err.status:
        return str(err.status)
    return "timeout" if isinstance(err, httpx.TimeoutException) else type(err).__name__


def good_client(url: str, pool: list[GoodRequest], refs: dict, offset: int, stop: float, timeout: float,
                tally: Tally) -> None:
    with httpx.Client(timeout=timeout) as client:
        for request in itertools.islice(itertools.cycle(pool), offset, None):
            if time.monotonic() >= stop:
                return
            try:
                reply = send_good(client, url, request)
            except Exception as err:  # whatever went wrong is an outcome to count, not a reason to stop
                with tally.lock:
                    tally.good[outcome(err)] += 1
                    tally.failures.append((request, f"{outcome(err)}: {err}"))
                continue
            with tally.lock:
                tally.tokens += reply.tokens
                if reply == refs[request]:
                    tally.good["exact"] += 1
                else:
                    tally.good["mismatch"] += 1
                    tally.mismatches.append((request, refs[request], reply))


def bad_client(url: str, plan: list[tuple[str, str, bytes | None]], offset: int, stop: float, timeout: float,
               tally: Tally) -> None:
    with httpx.Client(timeout=timeout) as client:
        for kind, path, payload in itertools.islice(itertools.cycle(plan), offset, None):
            if time.monotonic() >= stop:
                return
            try:
                if payload is None:
                    leave_mid_stream(client, url, path)
                    result = "left"
                else:
                    result = str(send_bad(client, url, path, payload))
            except Exception as err:  # an error, a timeout, a stream that ended before it could be left
                result = outcome(err)
            with tally.lock:
                tally.bad[kind][result] += 1


def references(url: str, pool: list[GoodRequest], timeout: float) -> dict[GoodRequest, Reply]:
    with httpx.Client(timeout=timeout) as client:
        return {request: send_good(client, url, request) for request in pool}


def soak(url: str, pool, refs, plan, clients: int, seconds: float, timeout: float,
         sampler: RssSampler) -> tuple[Tally, float, float]:
    """Every third client sends bad requests, the others good ones; progress every 10 s. Returns the tally, the
    start time and the time the last client finished."""
    tally, start = Tally(), time.monotonic()
    stop = start + seconds
    threads = [threading.Thread(target=bad_client, args=(url, plan, 7 * i, stop, timeout, tally), daemon=True)
               if i % 3 == 2 else
               threading.Thread(target=good_client, args=(url, pool, refs, i, stop, timeout, tally), daemon=True)
               for i in range(clients)]
    for t in threads:
        t.start()
    report = start + 10
    while any(t.is_alive() for t in threads):
        time.sleep(0.2)
        if time.monotonic() >= report:
            report += 10
            print(progress(tally, time.monotonic() - start, sampler.samples[-1][1]), flush=True)
    return tally, start, time.monotonic()


def progress(tally: Tally, elapsed: float, rss: int) -> str:
    with tally.lock:
        bad = tally.bad_statuses()
        return (f"{elapsed:5.0f} s: good {tally.good_sent()} ({tally.good['exact']} exact, "
                f"{tally.good['mismatch']} mismatched), bad {sum(bad.values())} "
                f"({sum(n for status, n in bad.items() if status.startswith('4'))} 4xx), "
                f"{tally.bad[DISCONNECT]['left']} left mid-stream, RSS {rss / 1e6:.0f} MB")


def server_gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    return {name.removeprefix("tiermoe_"): float(value) for name, value in
            (line.split() for line in text.splitlines() if line.startswith("tiermoe_"))}


def rss_figures(sampler: RssSampler, before: int, start: float, seconds: float, settled: int) -> dict[str, float]:
    mb = {"before": before / 1e6, "settled": settled / 1e6}
    for quarter in (25, 50, 75, 100):
        mb[f"{quarter}%"] = sampler.at(start + seconds * quarter / 100) / 1e6
    first, second = mb["50%"] - mb["before"], mb["100%"] - mb["50%"]
    limit = max(LEVEL_RATIO * first, LEVEL_FLOOR_MB)
    return {**mb, "first_half": first, "second_half": second, "limit": limit}


def plot_rss(sampler: RssSampler, start: float, seconds: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t - start for t, _ in sampler.samples], [rss / 1e6 for _, rss in sampler.samples], label="server RSS")
    ax.axvspan(0, seconds, color="tab:orange", alpha=0.12, label="soak")
    ax.set_xlabel("seconds from the start of the soak")
    ax.set_ylabel("RSS (MB)")
    ax.set_title("server memory during the mixed soak")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(args, load: tuple[float, ...], kind_paths: dict[str, tuple[str, ...]], tally: Tally, elapsed: float,
           rss: dict, gauges: dict) -> list[str]:
    """Prints the tables; returns the criteria that failed."""
    bad = tally.bad_statuses()
    bad_sent = sum(bad.values())
    bad_4xx = sum(n for status, n in bad.items() if status.startswith("4"))
    bad_5xx = sum(n for status, n in bad.items() if status.startswith("5"))
    bad_other = bad_sent - bad_4xx - bad_5xx
    left = tally.bad[DISCONNECT]
    good_failed = tally.good_sent() - tally.good["exact"] - tally.good["mismatch"]
    good_5xx = sum(n for status, n in tally.good.items() if status.startswith("5"))
    running = gauges.get("running_requests", 0) + gauges.get("queue_length", 0)
    levels_off = rss["second_half"] <= rss["limit"]
    print(f"\nsoak: {args.clients} clients ({args.clients - args.clients // 3} good, {args.clients // 3} bad) x "
          f"{args.seconds:.0f} s, bundled model in fp32; load average before {load[0]:.2f} / {load[1]:.2f} / "
          f"{load[2]:.2f} on {os.cpu_count()} cores")
    print(f"{'measure':<68}{'value':>16}")
    rows = [
        ("requests: good / bad (+ clients leaving mid-stream)",
         f"{tally.good_sent()} / {bad_sent} (+{sum(left.values())})"),
        ("good: exact match with the request run alone", str(tally.good["exact"])),
        ("good: mismatches (must be 0)", str(tally.good["mismatch"])),
        ("good: refused or failed (must be 0)", str(good_failed)),
        ("bad: answered 4xx (must equal the bad count)", str(bad_4xx)),
        ("5xx, good and bad (must be 0)", str(bad_5xx + good_5xx)),
        ("bad: errors, timeouts or 2xx (must be 0)", str(bad_other)),
        ("clients left mid-stream / of them not cleanly", f"{left['left']} / {sum(left.values()) - left['left']}"),
        ("server: requests aborted (client went away)", f"{gauges.get('requests_aborted_total', 0):.0f}"),
        ("server: running or queued after the soak (must be 0)", f"{running:.0f}"),
        ("good output tokens/s", f"{tally.tokens / elapsed:.1f}"),
        ("server RSS before / 25% / 50% / 75% / 100% (MB)",
         " / ".join(f"{rss[k]:.0f}" for k in ("before", "25%", "50%", "75%", "100%"))),
        (f"server RSS settled, {SETTLE_S} s after the soak (MB)", f"{rss['settled']:.0f}"),
        ("RSS growth: first half / second half of the soak (MB)",
         f"{rss['first_half']:+.0f} / {rss['second_half']:+.0f}"),
        (f"levels off: second half <= max({LEVEL_RATIO:g} x first, {LEVEL_FLOOR_MB} MB) = {rss['limit']:.0f} MB",
         "yes" if levels_off else "NO"),
    ]
    for name, value in rows:
        print(f"{name:<68}{value:>16}")
    print(f"\n{'bad request kind':<40}{'endpoints':>10}{'sent':>8}  statuses")
    for kind, paths in kind_paths.items():
        statuses = tally.bad[kind]
        shown = ", ".join(f"{status} x {n}" for status, n in sorted(statuses.items()))
        print(f"{kind:<40}{len(paths):>10}{sum(statuses.values()):>8}  {shown}")
    for request, ref, got in tally.mismatches[:5]:
        print(f"MISMATCH {request.name}\n  alone: {ref}\n  soak:  {got}")
    for request, why in tally.failures[:5]:
        print(f"FAILED {request.name}: {why}")
    checks = [("a good request differed from its run alone", tally.good["mismatch"] == 0),
              ("a good request was refused or failed", good_failed == 0),
              ("a bad request got no 4xx", bad_4xx == bad_sent),
              ("a client leaving mid-stream saw an error", sum(left.values()) == left["left"]),
              ("requests were left running or queued", running == 0),
              ("RSS did not level off", levels_off)]
    return [what for what, ok in checks if not ok]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    parser.add_argument("--seconds", type=float, default=60, help="length of the soak (default 60)")
    parser.add_argument("--clients", type=int, default=32, help="client threads, every third bad (default 32)")
    parser.add_argument("--distinct", type=int, default=12, help="distinct good requests (default 12)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds a request may take (default 120)")
    parser.add_argument("--plot", metavar="PATH", help="also draw the server's RSS over time into this image")
    args = parser.parse_args()
    if args.clients < 3 or args.seconds <= 0 or args.distinct < 1:
        parser.error("expected --clients >= 3 (one bad), --seconds > 0 and --distinct >= 1")
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = fp32_view(resolve_model(args.model), Path(tmp))
        print(f"starting a server on {model} (fp32, --max-request-bytes {MAX_REQUEST_BYTES}) ...", flush=True)
        server = ServerProcess(model, "--max-request-bytes", str(MAX_REQUEST_BYTES))
        try:
            proc = psutil.Process(server.proc.pid)
            complete(server.url, "warm up", 4)
            context = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
            kinds = bad_kinds(MAX_REQUEST_BYTES, context)
            plan = [(k.name, path, k.payload(path)) for k in kinds for path in k.paths]
            plan += [(DISCONNECT, path, None) for path in ENDPOINTS]
            kind_paths = {**{k.name: k.paths for k in kinds}, DISCONNECT: ENDPOINTS}
            pool = good_pool(args.distinct)
            print(f"{len(pool)} good requests, each alone for its reference ...", flush=True)
            refs = references(server.url, pool, args.timeout)
            sampler = RssSampler(proc).start()
            before = tree_rss(proc)
            print(f"{args.clients} clients for {args.seconds:.0f} s ({len(kinds) + 1} kinds of bad request) ...",
                  flush=True)
            tally, start, end = soak(server.url, pool, refs, plan, args.clients, args.seconds, args.timeout, sampler)
            time.sleep(SETTLE_S)
            settled = tree_rss(proc)
            sampler.stop()
            gauges = server_gauges(server.url)
        except Exception:
            print("server log (last lines):\n" + server.log_tail(), flush=True)
            raise
        finally:
            server.stop()
    rss = rss_figures(sampler, before, start, args.seconds, settled)
    failed = report(args, load, kind_paths, tally, end - start, rss, gauges)
    if args.plot:
        plot_rss(sampler, start, args.seconds, args.plot)
        print(f"RSS plot written to {args.plot}")
    for what in failed:
        print(f"FAILED: {what}")
    if failed:
        print("server log (last lines):\n" + server.log_tail())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
