"""Every flag of `tiermoe serve`, shared by the command, `python -m tiermoe.serve` (the torchrun entry point) and
the rank launcher (which hands rank 0's flags on to the other ranks). Light: `tiermoe serve --help` imports it, and
reads the library's defaults from tiermoe.cli.choices' copies rather than from modules that load torch."""

from __future__ import annotations

import argparse
import math
import re

from tiermoe.cli.api_key import API_KEY_VARIABLE, api_key_from_args
from tiermoe.cli.choices import DEFAULT_DIST_TIMEOUT_S
from tiermoe.cli.cpu_flags import add_cpu_flags
from tiermoe.cli.flags import non_negative_int, positive_int, running_count
from tiermoe.cli.generate_cmd import add_model_flags
from tiermoe.cli.placement_flags import add_dynamic_flags, add_placement_flags
from tiermoe.cli.recorder_flags import add_recorder_flags
from tiermoe.cli.sglang_flags import add_sglang_compat_flags
from tiermoe.cli.speculative_flags import add_speculative_flags
from tiermoe.config import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_RUNNING_REQUESTS,
    DEFAULT_PAGE_SIZE,
    MAX_RUNNING_REQUESTS,
    MIN_KV_TOKENS_PER_REQUEST,
    QUEUED_BATCHES,
    ServerConfig,
    normalise_origin,
)
from tiermoe.errors import TiermoeError
from tiermoe.server.decode_log import DEFAULT_INTERVAL
from tiermoe.server.output_parsers import REASONING_PARSERS, TOOL_CALL_PARSERS


def seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a number of seconds") from None
    if not 0 < number < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {value}")
    return number


def host_names(value: str) -> list[str]:
    """--allowed-hosts: a comma-separated list of host names (no port), or '*'."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    bad = [name for name in names if name != "*" and not re.fullmatch(r"\[?[A-Za-z0-9.:_-]+\]?", name)]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected host names separated by commas (e.g. chat.example.com,10.0.0.5) "
                                         f"or '*', got '{value}'")
    return names


def origins(value: str) -> list[str]:
    """--allowed-origins: a comma-separated list of web origins (the flag may also be repeated)."""
    try:
        return [normalise_origin(origin) for origin in value.split(",") if origin.strip()]
    except TiermoeError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `tiermoe serve` (also parsed by `python -m tiermoe.serve`, the torchrun entry point)."""
    add_model_flags(p, serving=True)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=positive_int, default=30000, help="port (default 30000)")
    p.add_argument("--served-model-name", help="model name reported by /v1/models (default: the directory name)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health (any user "
                   f"can read a command line in `ps`: prefer --api-key-file or ${API_KEY_VARIABLE})")
    p.add_argument("--api-key-file", metavar="PATH",
                   help=f"read the API key from this file (its first line); else ${API_KEY_VARIABLE} is used if set")
    p.add_argument("--allowed-origins", type=origins, action="extend", default=None, metavar="ORIGIN[,ORIGIN...]",
                   help="web pages (origins, e.g. http://localhost:3000) that may call the server from a browser, "
                        "besides its own: they get CORS headers for their origin; a request from any other page is "
                        "refused (403). '*' is not accepted: any page the browser opens could then use the server")
    p.add_argument("--allowed-hosts", type=host_names, action="extend", default=None, metavar="NAME[,NAME...]",
                   help="bound off loopback (--host 0.0.0.0): the Host names the server answers to (others get "
                        "421: a web page that points its own name at the server, DNS rebinding, is refused); "
                        "'*' answers any. Off loopback the server starts only with this or an API key")
    p.add_argument("--max-running-requests", type=running_count, default=None,
                   help=f"requests decoded together at most; more wait in a queue (default "
                        f"{DEFAULT_MAX_RUNNING_REQUESTS}; at most {MAX_RUNNING_REQUESTS}, and --max-total-tokens / "
                        f"{MIN_KV_TOKENS_PER_REQUEST}: each holds that many tokens of KV cache at least)")
    p.add_argument("--max-queued-requests", type=non_negative_int, default=None,
                   help="requests that may wait beyond the running ones; more are refused at once with 503 and "
                        f"Retry-After, costing the server nothing (default {QUEUED_BATCHES} x "
                        f"--max-running-requests: a wait of about {QUEUED_BATCHES} request lifetimes, beyond which "
                        "retrying later or elsewhere serves a client better; 0: no queue). Each request in "
                        "flight holds a connection: running + queued stay within the open-file limit (ulimit -n)")
    p.add_argument("--request-timeout", type=seconds, default=None, metavar="SECONDS",
                   help="stop a request that has been queued and generating for longer (the engine frees its "
                        "slot within a step): a 504, or a stream that ends with an error event (default: no limit)")
    p.add_argument("--body-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="a generation request's whole body must arrive within this many seconds, or it is answered "
                        "408; it holds no admission slot meanwhile, so slow or silent clients cannot lock others "
                        "out (default 30)")
    p.add_argument("--timeout-keep-alive", dest="keep_alive_timeout", type=seconds, default=5.0, metavar="SECONDS",
                   help="close a connection silent for this long: between requests, and from its start (default 5, "
                        "uvicorn's); a request's headers must come within --body-timeout")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="SGLang's: each event of a /generate stream carries the text and output_ids new since the "
                        "last one (default: all so far, as SGLang sends them)")
    p.add_argument("--watchdog-timeout", type=seconds, default=None, metavar="SECONDS",
                   help="stop the server when one engine step runs longer (a hung GPU kernel or CPU tier): every "
                        "request fails, one error line is logged, and the process exits with status 2, as SGLang's "
                        "watchdog does (default: no limit; SGLang's is 300, `kt run` passes 3000)")
    p.add_argument("--decode-log-interval", type=non_negative_int, default=DEFAULT_INTERVAL, metavar="STEPS",
                   help="log SGLang's decode-batch line every this many decode steps: running and queued requests, "
                        "KV tokens in use, and the tokens per second generated over those steps (default "
                        f"{DEFAULT_INTERVAL}, SGLang's; 0: never)")
    p.add_argument("--enable-expert-distribution-metrics", action="store_true",
                   help="export per-layer expert routing on /metrics: pairs routed, pairs the GPU tier served, "
                        "experts used, balancedness (mean / max expert load)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split the model's thinking into reasoning_content in chat replies and streams, for this "
                        "model family's format (SGLang's names)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="turn the model's tool calls into tool_calls (finish_reason tool_calls) for chat requests "
                        "that give tools, for this model family's format (SGLang's names)")
    p.add_argument("--chunked-prefill-size", type=positive_int, default=512,
                   help="prompt tokens prefilled per step over all requests (default 512)")
    p.add_argument("--page-size", type=page_size, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per page of the KV pool (default {DEFAULT_PAGE_SIZE}; 1-1024)")
    p.add_argument("--no-prefix-cache", "--disable-radix-cache", dest="no_prefix_cache", action="store_true",
                   help="do not reuse the KV pages of a prompt's prefix that earlier requests computed (reuse is on "
                        "by default for models whose layers are all full attention; /metrics counts the hits)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="max_tokens of requests that give none (default 256)")
    p.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="a request body longer than this is refused with 413 before it is read whole "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES >> 20} MiB, at most 1 GiB)")
    add_placement_flags(p)
    add_dynamic_flags(p)
    add_cpu_flags(p)
    add_recorder_flags(p)
    add_speculative_flags(p)
    add_sglang_compat_flags(p)
    g = p.add_argument_group("several GPUs (one rank per GPU; see docs/multi-gpu.md)")
    g.add_argument("--dist-timeout", dest="dist_timeout", type=seconds, default=DEFAULT_DIST_TIMEOUT_S,
                   help="seconds a rank waits for the others in one collective before it gives up with an error "
                        "(a rank died or hangs); idle ranks exchange heartbeats, so idleness never trips it "
                        f"(default {DEFAULT_DIST_TIMEOUT_S:g})")


def page_size(value: str) -> int:
    size = positive_int(value)
    if size > 1024:
        raise argparse.ArgumentTypeError(f"at most 1024 tokens per page, got {size}")
    return size


def server_config_from_args(args) -> ServerConfig:
    """The ServerConfig the flags ask for (checked before the model loads). Without --max-running-requests: 32, or
    as many as --max-total-tokens holds if fewer."""
    budget = args.max_total_tokens
    running = args.max_running_requests
    if running is None:
        running = DEFAULT_MAX_RUNNING_REQUESTS if budget is None else \
            max(1, min(DEFAULT_MAX_RUNNING_REQUESTS, budget // MIN_KV_TOKENS_PER_REQUEST))
    return ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                        api_key=api_key_from_args(args), max_running_requests=running, max_total_tokens=budget,
                        chunked_prefill_size=args.chunked_prefill_size, default_max_tokens=args.default_max_tokens,
                        max_request_bytes=args.max_request_bytes, max_queued_requests=args.max_queued_requests,
                        request_timeout=args.request_timeout, body_timeout=args.body_timeout,
                        keep_alive_timeout=args.keep_alive_timeout,
                        allowed_origins=tuple(args.allowed_origins or ()),
                        allowed_hosts=tuple(args.allowed_hosts or ()),
                        watchdog_timeout=args.watchdog_timeout,
                        expert_distribution_metrics=args.enable_expert_distribution_metrics,
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        incremental_streaming_output=args.incremental_streaming_output)
