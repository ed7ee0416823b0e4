"""The well-behaved clients of the adversarial soak (benchmarks/soak_adversarial.py), on one event loop: each streams
greedy requests (soak/requests.py's pool) and every third request it sends is malformed (its bad kinds, each due a
4xx); the time to each piece of text is kept for the latency figures. Beside them, /health is polled every second
and the server's open descriptors are counted (/proc/PID/fd)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import sys
import time
from dataclasses import dataclass, field

import httpx
import psutil

from soak.requests import OLLAMA, GoodRequest, Refused, read_stream, send_bad

JSON_HEADERS = {"content-type": "application/json"}
REQUEST_S = 45  # one well-behaved request, whole; also the drain at the end of a phase
HEALTH_TIMEOUT_S = 5
PROGRESS_S = 10


@dataclass
class PhaseTally:
    streams: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)  # outcome -> count
    malformed: collections.Counter = field(default_factory=collections.Counter)  # status or error -> count
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    def fail(self, what: str, why: str) -> None:
        self.failures[what] += 1
        if len(self.examples) < 5:
            self.examples.append(why[:300])


@dataclass
class Watch:
    """What the once-a-second poll saw: (monotonic time, /health ok, seconds it took, server descriptors)."""

    server: psutil.Process
    samples: list[tuple[float, bool, float, int]] = field(default_factory=list)
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> (start, end)
    cpu: dict[str, tuple[float, float]] = field(default_factory=dict)  # phase -> CPU seconds (server, clients)

    def cpu_seconds(self) -> tuple[float, float]:
        return tuple(sum(p.cpu_times()[:2]) for p in (self.server, psutil.Process()))

    def during(self, phase: str) -> list[tuple[float, bool, float, int]]:
        start, end = self.windows[phase]
        return [s for s in self.samples if start <= s[0] <= end]


def carries_text(path: str, line: str) -> bool:
    """Whether a line of a stream brings generated text (not a role chunk, an empty delta, usage or the end)."""
    if path in OLLAMA:
        part = json.loads(line) if line else {}
        return bool(part.get("response") or part.get("message", {}).get("content"))
    if not line.startswith("data: {"):
        return False
    chunk = json.loads(line.removeprefix("data: "))
    return any(c.get("delta", {}).get("content") or c.get("text") for c in chunk.get("choices", ()))


async def timed_stream(client: httpx.AsyncClient, url: str, request: GoodRequest) -> list[float]:
    """Stream `request` whole (Refused otherwise); the seconds from sending it to each piece of text."""
    start, lines, times = time.perf_counter(), [], []
    async with client.stream("POST", url + request.path, content=request.payload(), headers=JSON_HEADERS) as r:
        if r.status_code != 200:
            raise Refused(r.status_code, (await r.aread()).decode(errors="replace")[:300])
        async for line in r.aiter_lines():
            lines.append(line)
            if carries_text(request.path, line):
                times.append(time.perf_counter() - start)
    read_stream(request.path, lines)  # a stream that carried an error or ended early raises
    return times


async def good_stream(client: httpx.AsyncClient, url: str, request: GoodRequest, tally: PhaseTally) -> None:
    try:
        times = await asyncio.wait_for(timed_stream(client, url, request), REQUEST_S)
    except (httpx.HTTPError, Refused, TimeoutError, ValueError, KeyError, TypeError) as err:
        outcome = str(err.status) if isinstance(err, Refused) and err.status else type(err).__name__
        tally.fail(outcome, f"{request.name}: {outcome}: {err}")
        return
    tally.streams += 1
    if times:
        tally.ttft.append(times[0])
        tally.itl.extend(b - a for a, b in itertools.pairwise(times))


async def malformed(client: httpx.Client, url: str, bad: tuple[str, str, bytes], tally: PhaseTally) -> None:
    """Send a malformed request on a thread, with httpx's blocking client: when the server answers a body over the
    limit (413) and closes before it has all arrived, the blocking client still reads the answer, while the
    asynchronous one reports the broken write as a ReadError (anyio's BrokenResourceError)."""
    kind, path, payload = bad
    try:
        status = await asyncio.to_thread(send_bad, client, url, path, payload)
    except httpx.HTTPError as err:
        tally.malformed[type(err).__name__] += 1
        tally.fail(f"malformed: {type(err).__name__}", f"{kind} {path}: {type(err).__name__}: {err!r}")
        return
    tally.malformed[str(status)] += 1
    if not 400 <= status < 500:
        tally.fail(f"malformed: {status}", f"{kind} {path}: answered {status}")


async def client_loop(i: int, url: str, pool: list[GoodRequest], bad: list, deadline: float,
                      tally: PhaseTally) -> None:
    """Every third request malformed, the others streamed, until the deadline."""
    async with httpx.AsyncClient(timeout=REQUEST_S) as client:
        with httpx.Client(timeout=REQUEST_S) as blocking:
            for n in itertools.count():
                if time.monotonic() >= deadline:
                    return
                if n % 3 == 2:
                    await malformed(blocking, url, bad[(7 * i + n) % len(bad)], tally)
                else:
                    await good_stream(client, url, pool[(i + n) % len(pool)], tally)


async def good_phase(name: str, clients: int, seconds: float, url: str, pool: list, bad: list,
                     watch: Watch) -> PhaseTally:
    """`clients` clients until `seconds` have passed, then until their last requests end (REQUEST_S at most)."""
    tally, start, cpu = PhaseTally(), time.monotonic(), watch.cpu_seconds()
    tasks = {asyncio.create_task(client_loop(i, url, pool, bad, start + seconds, tally)) for i in range(clients)}
    pending, shown = tasks, start
    while pending and time.monotonic() < start + seconds + REQUEST_S:
        _, pending = await asyncio.wait(pending, timeout=1)
        if time.monotonic() - shown >= PROGRESS_S:
            shown = time.monotonic()
            progress(name, shown - start, tally, watch)
    for task in pending:  # each request has its own REQUEST_S deadline: this is a guard, never expected
        task.cancel()
        tally.fail("cut at the drain", f"a client still busy {REQUEST_S} s after the phase")
    await asyncio.gather(*tasks, return_exceptions=True)
    watch.windows[name] = (start, time.monotonic())
    watch.cpu[name] = tuple(b - a for a, b in zip(cpu, watch.cpu_seconds()))
    return tally


def progress(name: str, elapsed: float, tally: PhaseTally, watch: Watch) -> None:
    failed_health = sum(1 for s in watch.samples if not s[1])
    print(f"  {name} {elapsed:4.0f} s: {tally.streams} streams, {sum(tally.failures.values())} failed, "
          f"{sum(tally.malformed.values())} malformed sent, /health {len(watch.samples)} polls "
          f"({failed_health} failed), server descriptors {watch.samples[-1][3] if watch.samples else '?'}",
          file=sys.stderr, flush=True)


async def poll(url: str, watch: Watch) -> None:
    """/health every second (one at a time: a slow answer delays the next), and the server's descriptors."""
    async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
        while True:
            started = time.monotonic()
            try:
                ok = (await client.get(url + "/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            watch.samples.append((started, ok, time.monotonic() - started, descriptors(watch.server)))
            await asyncio.sleep(max(0.0, started + 1 - time.monotonic()))


def descriptors(proc: psutil.Process) -> int:
    """Entries of /proc/PID/fd (-1 once the server has gone)."""
    try:
        return proc.num_fds()
    except psutil.Error:
        return -1


async def warm_up(url: str, pool: list[GoodRequest]) -> None:
    """Each good request once, alone: the first request of a shape pays one-time costs (a chat template compiled,
    kernels for a new batch size) that belong to neither phase, and would flatter the ratios by slowing `alone`."""
    async with httpx.AsyncClient(timeout=REQUEST_S) as client:
        for request in pool:
            await good_stream(client, url, request, PhaseTally())
