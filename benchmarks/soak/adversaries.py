"""The hostile clients of the adversarial soak (benchmarks/soak_adversarial.py), run in a process of their own: their
event loop (thousands of sockets) then never delays the well-behaved clients' loop, whose timings are the measure.

- idle connections: connect and send nothing, or half of them a partial request line; each reconnects as soon as
  the server closes it, so `idle` sockets are held all the time;
- slow bodies: a POST that declares Content-Length: 4000 and sends one byte of its body every 5-10 s; each
  reconnects once answered (a 408 at --body-timeout);
- one long generation: 8192 tokens, ignore_eos, two stop strings that never match, streamed;
- one scoring request: a prompt of about 4k tokens with echo, logprobs 5 and max_tokens 1 (/v1/completions);
- `batches` SGLang /generate batches of `batch_size` prompts sent at once: a batch larger than the free slots is
  answered 503 with Retry-After, which is a correct answer here, counted apart from any other.

Everything counts into one Counter; `run_adversaries` ramps the connections up, sets `ready`, starts the requests,
and when `stop` is set cancels everything and puts the Counter (a dict) on `results`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import httpx

from tiermoe.config import raise_open_files_limit

SLOW_BODY_BYTES = 4000
RAMP_RATE = 400  # connections opened per second while ramping up: a burst of 2,000 would overflow the listen backlog
# Strings the random model's output will not contain: the stop-string search then runs over the whole output.
NEVER_MATCH = ("<<never-stop-a:7f3e>>", "<<never-stop-b:91c2>>")
PROGRESS_S = 10
GAP_WINDOW = 200  # gaps at each end of the long generation compared (per-step work must not grow); fewer if short


@dataclass(frozen=True)
class Plan:
    url: str
    idle: int = 2000
    slow: int = 170
    slow_gap_s: tuple[float, float] = (5.0, 10.0)
    long_tokens: int = 8192  # 0: no long generation
    score_words: int = 4096  # " hello" is one token of Qwen's vocabulary; 0: no scoring request
    batches: int = 10
    batch_size: int = 80
    batch_tokens: int = 64
    ramp_s: float = 20.0  # at most this long to open every connection before `ready`

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)


def run_adversaries(plan: Plan, ready, stop, results) -> None:
    """The process's entry point (multiprocessing): `ready` and `stop` are Events, `results` a Queue."""
    raise_open_files_limit()  # a socket each: 2,000 and more
    tally: collections.Counter = collections.Counter()
    try:
        asyncio.run(_attack(plan, ready, stop, tally))
    finally:
        ready.set()  # the parent never waits for a ramp that failed
        results.put(dict(tally))


async def _attack(plan: Plan, ready, stop, tally: collections.Counter) -> None:
    host, port = plan.host_port
    tasks = [asyncio.create_task(_idle(host, port, i % 2 == 1, i / RAMP_RATE, tally)) for i in range(plan.idle)]
    tasks += [asyncio.create_task(_slow_body(plan, host, port, i / RAMP_RATE, tally)) for i in range(plan.slow)]
    deadline = time.monotonic() + plan.ramp_s
    while time.monotonic() < deadline and (tally["idle open"] < plan.idle or tally["slow open"] < plan.slow):
        await asyncio.sleep(0.1)
    tally["ramp s"] = plan.ramp_s - max(0.0, deadline - time.monotonic())
    tally["idle open at ready"], tally["slow open at ready"] = tally["idle open"], tally["slow open"]
    # no read timeout: the long generation and the batches end when the phase does
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=httpx.Limits(max_connections=None)) \
            as client:
        if plan.long_tokens:
            tasks.append(asyncio.create_task(_long_generation(client, plan, tally)))
        if plan.score_words:
            tasks.append(asyncio.create_task(_scoring(client, plan, tally)))
        tasks += [asyncio.create_task(_batch(client, plan, k, tally)) for k in range(plan.batches)]
        ready.set()
        cpu, started = time.process_time(), time.monotonic()
        await _until_stopped(stop, tally)
        tally["cores"] = (time.process_time() - cpu) / (time.monotonic() - started)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_stopped(stop, tally: collections.Counter) -> None:
    started, shown = time.monotonic(), time.monotonic()
    while not stop.is_set():
        await asyncio.sleep(0.2)
        if time.monotonic() - shown >= PROGRESS_S:
            shown = time.monotonic()
            print(f"  adversaries {shown - started:4.0f} s: idle open {tally['idle open']} ({tally['idle connects']} "
                  f"connects), slow open {tally['slow open']} ({tally['slow answered 408']} x 408), long generation "
                  f"{tally['long chunks']} chunks, batches {tally['batch 200']} x 200 / {tally['batch 503 retry']} x "
                  f"503", file=sys.stderr, flush=True)


async def _idle(host: str, port: int, partial: bool, delay: float, tally: collections.Counter) -> None:
    """Hold a connection that sends nothing (or a partial request line), again and again."""
    await asyncio.sleep(delay)
    kind = "partial" if partial else "silent"
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as err:
            tally[f"idle connect failed: {type(err).__name__}"] += 1
            await asyncio.sleep(1)  # the server refused: do not spin
            continue
        tally["idle connects"] += 1
        tally["idle open"] += 1
        opened = time.monotonic()
        try:
            if partial:
                writer.write(b"GET /v1/mo")
            answer = await reader.read(4096)  # b"" when the server closes it
            tally[f"idle {kind} closed by the server"] += 1
            tally[f"idle {kind} seconds held"] += time.monotonic() - opened
            if answer:
                tally[f"idle {kind} answered {answer.split(b' ', 2)[1].decode(errors='replace')}"] += 1
        except OSError:
            tally[f"idle {kind} reset"] += 1
        finally:
            tally["idle open"] -= 1
            writer.close()


def _slow_payload(size: int) -> bytes:
    """A valid completion request padded with spaces to exactly `size` bytes."""
    head = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()
    return head + b" " * (size - len(head))


async def _slow_body(plan: Plan, host: str, port: int, delay: float, tally: collections.Counter) -> None:
    """Send the headers, then a byte of the body every 5-10 s until the server answers; then again."""
    await asyncio.sleep(delay)
    body = _slow_payload(SLOW_BODY_BYTES)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as err:
            tally[f"slow connect failed: {type(err).__name__}"] += 1
            await asyncio.sleep(1)
            continue
        tally["slow connects"] += 1
        tally["slow open"] += 1
        try:
            writer.write(head)
            tally[f"slow answered {await _trickle(reader, writer, body, plan.slow_gap_s)}"] += 1
        except OSError:
            tally["slow reset"] += 1
        finally:
            tally["slow open"] -= 1
            writer.close()


async def _trickle(reader, writer, body: bytes, gap_s: tuple[float, float]) -> str:
    """The status the server answered with ('closed' when it closed without one)."""
    for k in range(len(body)):
        try:
            answer = await asyncio.wait_for(reader.read(4096), random.uniform(*gap_s))
        except TimeoutError:
            writer.write(body[k:k + 1])
            continue
        return answer.split(b" ", 2)[1].decode(errors="replace") if answer else "closed"
    answer = await reader.read(4096)
    return answer.split(b" ", 2)[1].decode(errors="replace") if answer else "closed"


async def _long_generation(client: httpx.AsyncClient, plan: Plan, tally: collections.Counter) -> None:
    payload = {"prompt": "Tell me a very long story.", "max_tokens": plan.long_tokens, "ignore_eos": True,
               "stop": list(NEVER_MATCH), "stream": True, "stream_options": {"include_usage": True}}
    started, times = time.monotonic(), []
    try:
        async with client.stream("POST", plan.url + "/v1/completions", json=payload) as r:
            tally[f"long status {r.status_code}"] += 1
            if r.status_code != 200:
                _say("the long generation", r.status_code, (await r.aread()).decode(errors="replace"))
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    tally["long finished"] += 1
                elif line.startswith("data: "):
                    _long_chunk(json.loads(line.removeprefix("data: ")), times, tally)
    except httpx.HTTPError as err:
        tally[f"long failed: {type(err).__name__}"] += 1
    finally:
        _long_figures(times, started, tally)


def _long_chunk(chunk: dict, times: list[float], tally: collections.Counter) -> None:
    if "error" in chunk:
        tally["long error events"] += 1
    if any(choice.get("text") for choice in chunk.get("choices", ())):
        times.append(time.monotonic())
        tally["long chunks"] += 1
    if chunk.get("usage"):
        tally["long tokens"] = chunk["usage"]["completion_tokens"]


def _long_figures(times: list[float], started: float, tally: collections.Counter) -> None:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    window = min(GAP_WINDOW, len(gaps) // 2)
    if window:
        tally["long first gaps median ms"] = 1000 * statistics.median(gaps[:window])
        tally["long last gaps median ms"] = 1000 * statistics.median(gaps[-window:])
    if times:
        tally["long chunks/s"] = len(times) / (times[-1] - started)


async def _scoring(client: httpx.AsyncClient, plan: Plan, tally: collections.Counter) -> None:
    payload = {"prompt": " ".join(["hello"] * plan.score_words), "echo": True, "logprobs": 5, "max_tokens": 1}
    started = time.monotonic()
    try:
        r = await client.post(plan.url + "/v1/completions", json=payload)
    except httpx.HTTPError as err:
        tally[f"score failed: {type(err).__name__}"] += 1
        return
    tally[f"score status {r.status_code}"] += 1
    if r.status_code != 200:
        _say("the scoring request", r.status_code, r.text)
    tally["score seconds"] = time.monotonic() - started
    if r.status_code == 200:
        tally["score prompt tokens"] = r.json()["usage"]["prompt_tokens"]


async def _batch(client: httpx.AsyncClient, plan: Plan, k: int, tally: collections.Counter) -> None:
    prompts = [f"Batch {k}, prompt {i}: once upon a time" for i in range(plan.batch_size)]
    payload = {"text": prompts, "sampling_params": {"max_new_tokens": plan.batch_tokens, "ignore_eos": True}}
    try:
        r = await client.post(plan.url + "/generate", json=payload)
    except httpx.HTTPError as err:
        tally[f"batch failed: {type(err).__name__}"] += 1
        return
    if r.status_code == 503:
        tally["batch 503 retry" if r.headers.get("retry-after") else "batch 503 without Retry-After"] += 1
    else:
        tally[f"batch {r.status_code}"] += 1
    if r.status_code not in (200, 503):
        _say(f"batch {k}", r.status_code, r.text)


def _say(what: str, status: int, text: str) -> None:
    print(f"  adversaries: {what} was answered {status}: {text[:300]}", file=sys.stderr, flush=True)
