"""Small validated settings shared by commands and the library."""

from __future__ import annotations

import ipaddress
import math
import os
import resource
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from tiermoe.errors import TiermoeError


def check_device(device: str) -> str:
    """Validate a --gpu-device value: "cpu", "cuda" or "cuda:N" for a CUDA device that exists."""
    import torch  # here, not at the top: the CLI's parsers read this module's settings without loading torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise TiermoeError(f"--gpu-device '{device}' is not a device; expected cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise TiermoeError(f"--gpu-device '{device}' is not supported; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise TiermoeError(f"--gpu-device {device}: CUDA is not available on this machine; use --gpu-device cpu")
    index = parsed.index or 0
    if index >= torch.cuda.device_count():
        raise TiermoeError(f"--gpu-device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_GPUS = 4096  # GPUs one plan may name: beyond any cluster a CPU tier serves, few enough to print a plan


def machine_cpus() -> int:
    """Logical CPUs of this machine (the bound of every count of threads or processes on it)."""
    return os.cpu_count() or 1


PLACEMENT_STRATEGIES = ("uniform", "front-loading", "random", "frequency", "balanced")
GPU_SPLIT_METHODS = ("balanced", "layers", "round-robin")


@dataclass(frozen=True)
class PlacementConfig:
    """Which experts go to the GPU tier (flags of `place`, `generate`, `serve`; SGLang-kt names in comments).

    num_gpu_experts: per MoE layer, over all GPUs together (--kt-num-gpu-experts).
    gpu_experts_ratio: share of all routed experts, floor(R x MoE layers x E); wins over num_gpu_experts
      (--kt-gpu-experts-ratio). gpu_memory_gb: GPU memory per GPU that tiermoe may use, or "auto" (CUDA only);
      the expert count then follows from the model's real bytes. Exactly one way of sizing is used: the ratio,
      else the count, else the memory.
    """

    strategy: str = "uniform"  # --kt-expert-placement-strategy
    num_gpu_experts: int | None = None
    gpu_experts_ratio: float | None = None
    gpu_memory_gb: float | str | None = None
    init_expert_location: str | None = None  # statistics file (.pt)
    seed: int = 42  # random strategy
    num_gpus: int = 1
    gpu_split: str = "balanced"
    kv_cache_tokens: int = 8192  # KV cache reserved by --gpu-memory-gb
    prefill_buffer_gb: float = 0.0  # layerwise-prefill buffer reserved by --gpu-memory-gb
    max_running: int = 16  # sequences at once: each runs on its own thread, whose cuBLAS workspace is reserved

    def __post_init__(self):
        strategy = self.strategy.replace("_", "-")
        object.__setattr__(self, "strategy", strategy)
        if strategy not in PLACEMENT_STRATEGIES:
            raise TiermoeError(f"placement strategy '{self.strategy}' is unknown; choose one of: "
                               f"{', '.join(PLACEMENT_STRATEGIES)}")
        if self.num_gpu_experts is not None and self.num_gpu_experts < 0:
            raise TiermoeError(f"num_gpu_experts must be >= 0 (per MoE layer), got {self.num_gpu_experts}")
        if self.gpu_experts_ratio is not None and not 0.0 <= self.gpu_experts_ratio <= 1.0:
            raise TiermoeError(f"gpu_experts_ratio must be between 0.0 and 1.0, got {self.gpu_experts_ratio}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb != "auto":
            memory = self.gpu_memory_gb
            if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory) \
                    or memory < 0:
                raise TiermoeError(f"gpu_memory_gb must be a finite number of GB >= 0 or 'auto', got {memory!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise TiermoeError(f"the placement seed must be between 0 and 2**64 - 1, got {self.seed}")
        if not 1 <= self.num_gpus <= MAX_GPUS:
            raise TiermoeError(f"num_gpus must be between 1 and {MAX_GPUS}, got {self.num_gpus}")
        if self.gpu_split not in GPU_SPLIT_METHODS:
            raise TiermoeError(f"gpu_split '{self.gpu_split}' is unknown; choose one of: {', '.join(GPU_SPLIT_METHODS)}")
        if self.kv_cache_tokens < 0 or not 0 <= self.prefill_buffer_gb < math.inf:
            raise TiermoeError("kv_cache_tokens and prefill_buffer_gb must be finite and >= 0")
        if self.max_running < 1:
            raise TiermoeError(f"max_running must be >= 1, got {self.max_running}")

    @property
    def sized(self) -> bool:
        return any(v is not None for v in (self.num_gpu_experts, self.gpu_experts_ratio, self.gpu_memory_gb))


CPU_BACKENDS = ("native", "torch", "kt")  # native: tiermoe's kernels (tiermoe.experts.native), the default
CPU_EXPERT_DTYPES = ("bf16", "int8", "int4", "int6")
NON_EXPERT_DTYPES = ("bf16", "int8", "int4", "int6")
# Where a 4-bit model keeps more bits: its experts' down projections in int6, as llama.cpp's Q4_K_M keeps ffn_down at
# Q5 / Q6 (BENCHMARKS.md, "int6 where 4 bits cost most"); --cpu-expert-down-dtype overrides.
DOWN_FORMAT_UNDER = {"int4": "int6"}
NON_EXPERT_AS_LOADED = "none"  # --non-expert-dtype none: torch's linears in the checkpoint's dtype
THREADS_PER_CPU = 4


def expert_down_format(expert_fmt: str | None, asked: str | None = None) -> str | None:
    """The format the routed experts' down projections are held in: `asked` (--cpu-expert-down-dtype), else
    DOWN_FORMAT_UNDER's for `expert_fmt`, else `expert_fmt` itself."""
    return asked or DOWN_FORMAT_UNDER.get(expert_fmt, expert_fmt)


@dataclass(frozen=True)
class CPUConfig:
    """The CPU tier: which backend computes it, the format its experts are stored in, and its threads.

    expert_dtype None keeps the checkpoint's dtype. threads None: physical cores less one for the caller (at
    least 1); see tiermoe.experts.threads and docs/cpu-backends.md. At most THREADS_PER_CPU per logical CPU:
    a few more threads than cores is a measurement (tests check results do not depend on the team size), a
    thousand is a typo that starts a thousand threads (100000 aborts in the native pool).
    """

    backend: str = "native"  # --cpu-backend
    expert_dtype: str | None = None  # --cpu-expert-dtype
    threads: int | None = None  # --cpu-threads
    numa_nodes: tuple[int, ...] | None = None  # --kt-numa-nodes: one thread pool per entry, pinned to that node
    # --kt-max-deferred-experts-per-token: per token, this many of the lowest-weighted CPU-tier slots are added in
    # the next MoE layer (an approximation, tiermoe.layers.deferred_experts); 0 keeps outputs exact.
    deferred_experts: int = 0
    # --non-expert-dtype: CPU-only runs hold the non-expert linears (attention, dense and shared MLPs, LM head)
    # packed in this format and compute them with the same kernels (tiermoe.model.non_expert_quant); "none" keeps
    # torch's linears in the checkpoint's dtype; None: bf16 for a bf16 model run CPU-only, else as loaded
    # (tiermoe.model.cpu_only).
    non_expert_dtype: str | None = None
    # --head-dtype: the format of the packed LM head, where the non-expert linears are packed; None follows
    # --non-expert-dtype, int6 under int4 (tiermoe.model.non_expert_quant.head_format).
    head_dtype: str | None = None
    # --cpu-expert-down-dtype: the format of the routed experts' down projections on the native CPU tier; None
    # follows --cpu-expert-dtype, int6 under int4 (DOWN_FORMAT_UNDER, `down_format`).
    expert_down_dtype: str | None = None

    @property
    def down_format(self) -> str | None:
        """The experts' down projections' format on the native CPU tier (None: the checkpoint's dtype, as
        `expert_dtype` None)."""
        return expert_down_format(self.expert_dtype, self.expert_down_dtype)

    @property
    def packs_non_experts(self) -> bool:
        """Whether the non-expert linears are held packed (a format chosen, not None or "none")."""
        return self.non_expert_dtype in NON_EXPERT_DTYPES

    def __post_init__(self):
        if self.non_expert_dtype not in (None, NON_EXPERT_AS_LOADED, *NON_EXPERT_DTYPES):
            raise TiermoeError(f"non-expert dtype '{self.non_expert_dtype}' is unknown; choose one of: "
                               f"{', '.join((NON_EXPERT_AS_LOADED, *NON_EXPERT_DTYPES))}")
        if self.head_dtype not in (None, *NON_EXPERT_DTYPES):
            raise TiermoeError(f"LM head dtype '{self.head_dtype}' is unknown; choose one of: "
                               f"{', '.join(NON_EXPERT_DTYPES)}")
        if not isinstance(self.deferred_experts, int) or self.deferred_experts < 0:
            raise TiermoeError(f"deferred experts per token must be an integer >= 0, got {self.deferred_experts!r}")
        if self.numa_nodes is not None:
            object.__setattr__(self, "numa_nodes", tuple(self.numa_nodes))
            if not self.numa_nodes or any(not isinstance(n, int) or n < 0 for n in self.numa_nodes):
                raise TiermoeError(f"numa nodes must be node ids >= 0, got {list(self.numa_nodes)}")
        if self.backend not in CPU_BACKENDS:
            raise TiermoeError(f"cpu backend '{self.backend}' is unknown; choose one of: {', '.join(CPU_BACKENDS)}")
        if self.expert_dtype is not None and self.expert_dtype not in CPU_EXPERT_DTYPES:
            raise TiermoeError(f"cpu expert dtype '{self.expert_dtype}' is unknown; choose one of: "
                               f"{', '.join(CPU_EXPERT_DTYPES)}")
        if self.expert_down_dtype is not None:
            pairs = {("int4", "int6"), ("int6", "int4")}  # gate_up and down must pad I alike (quant.k_align)
            fmt = self.expert_dtype
            if self.expert_down_dtype not in CPU_EXPERT_DTYPES:
                raise TiermoeError(f"cpu expert down dtype '{self.expert_down_dtype}' is unknown; choose one of: "
                                   f"{', '.join(CPU_EXPERT_DTYPES)}")
            down = self.expert_down_dtype
            if self.backend != "native" or (fmt != down and (fmt, down) not in pairs):
                raise TiermoeError(f"--cpu-expert-down-dtype {self.expert_down_dtype} needs the native backend and "
                                   f"--cpu-expert-dtype int4 or int6 (got {self.backend}, {fmt or 'as loaded'})")
        if self.threads is not None and self.threads < 1:
            raise TiermoeError(f"cpu threads must be >= 1, got {self.threads}")
        limit = THREADS_PER_CPU * machine_cpus()
        if self.threads is not None and self.threads > limit:
            raise TiermoeError(f"cpu threads {self.threads}: this machine has {machine_cpus()} CPUs; at most {limit} "
                               f"({THREADS_PER_CPU} per CPU; the default, one per physical core less one, is fastest)")


DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: a prompt of a million tokens and more
MAX_REQUEST_BYTES_CAP = 1 << 30  # a body is parsed in memory several times over: 1 GiB is already a lot

DEFAULT_PAGE_SIZE = 16  # tokens per KV page: vLLM's default block size; a sequence wastes less than one page
# Requests one engine runs at once, at most. Each running request holds a KV cache of at least
# MIN_KV_TOKENS_PER_REQUEST tokens (a prompt token and a generated one), so --max-total-tokens T holds at most
# T // 2 of them (SGLang's own default is that, max_total_tokens // 2, within a request pool of at most 4096).
# Each running request also costs the step its page tables and Python bookkeeping: past a few thousand, that
# outweighs what batching saves.
MAX_RUNNING_REQUESTS = 4096
MIN_KV_TOKENS_PER_REQUEST = 2
DEFAULT_MAX_RUNNING_REQUESTS = 32
# The wait queue by default: this many batches of --max-running-requests. A request waits at most about that many
# request lifetimes; beyond it, a 503 that says when to retry serves the client better than an unbounded wait.
QUEUED_BATCHES = 4
# Every request in flight holds a connection, a file descriptor; this many are kept for the rest (model files,
# CUDA, logs, the ranks' sockets) when the open-file limit (ulimit -n) bounds the requests in flight.
FILE_DESCRIPTORS_KEPT = 256


def open_files_limit() -> int:
    """Files this process may open (the soft RLIMIT_NOFILE, `ulimit -n`)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2**31 if soft == resource.RLIM_INFINITY else soft


# What the soft open-file limit is raised to when the hard limit is unlimited: Linux's default fs.nr_open, the most
# one process may open there anyway.
OPEN_FILES_WANTED = 1 << 20


def raise_open_files_limit() -> tuple[int, int] | None:
    """Raise the soft RLIMIT_NOFILE (`ulimit -n`) to the hard limit, as nginx and SGLang do: every connection holds
    a file descriptor, and the soft limit many systems start processes with (1024) is filled by a few hundred idle
    or slow clients, after which accept() fails for everyone. Any process may raise its soft limit up to the hard
    one. Returns (old, new) when raised; None when already there or the system refused (the old limit stays)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ValueError, OSError):  # macOS refuses more than kern.maxfilesperproc with an unlimited hard limit
        return None
    return soft, wanted


def connection_room() -> int:
    """Requests that may be in flight at once: one connection (file descriptor) each."""
    return max(1, open_files_limit() - FILE_DESCRIPTORS_KEPT)


def normalise_origin(value: str) -> str:
    """One web origin of --allowed-origins as a browser sends it in `Origin`: scheme://host[:port], lower case,
    no path, no default port. `*` and `null` are refused: a wildcard lets every page the browser opens drive the
    server and read its answers, and `null` is the origin of every sandboxed frame and local file alike."""
    text = value.strip().lower().removesuffix("/")
    if text in ("*", "null"):
        raise TiermoeError(f"--allowed-origins '{text}' is not accepted: it would let any web page the browser opens "
                           "use this server; list each origin (e.g. http://localhost:3000)")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query \
            or parts.fragment or parts.username is not None:
        raise TiermoeError(f"--allowed-origins '{value}' is not an origin; expected scheme://host[:port] with "
                           "scheme http or https and no path (e.g. http://localhost:3000)")
    default_port = {"http": 80, "https": 443}[parts.scheme]
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port not in (None, default_port) else "")


def is_loopback(name: str) -> bool:
    """Whether a host name (without port; IPv6 with or without brackets) always means this machine."""
    name = name.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """`tiermoe serve`: where it listens, who may call it, and how much it batches and queues."""

    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    api_key: str | None = None
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    max_total_tokens: int | None = None
    chunked_prefill_size: int = 512
    default_max_tokens: int = 256  # when a request gives no max_tokens
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a longer body is a 413, never read whole
    max_queued_requests: int | None = None  # waiting beyond the running ones; None: see queue_limit
    request_timeout: float | None = None  # seconds a request may spend in the engine; None: no limit
    body_timeout: float = 30.0  # seconds from a request's arrival by which its whole body must have come (408 after)
    keep_alive_timeout: float = 5.0  # seconds a connection may stay silent (uvicorn's --timeout-keep-alive)
    allowed_origins: tuple[str, ...] = ()  # web pages (besides the server's own) that may call it (CORS)
    allowed_hosts: tuple[str, ...] = ()  # Host names it answers to off loopback ("*": any); () with a key: any
    watchdog_timeout: float | None = None  # seconds one engine step may run before the server stops; None: no limit
    expert_distribution_metrics: bool = False  # per-layer expert routing on /metrics
    reasoning_parser: str | None = None  # --reasoning-parser: reasoning_content in chat replies
    tool_call_parser: str | None = None  # --tool-call-parser: tool_calls in chat replies
    incremental_streaming_output: bool = False  # /generate streams send each event's new text and ids, not all

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise TiermoeError(f"port must be 1-65535, got {self.port}")
        for name in ("max_running_requests", "chunked_prefill_size", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise TiermoeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise TiermoeError(f"max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if not 0 < self.max_request_bytes <= MAX_REQUEST_BYTES_CAP:
            raise TiermoeError(f"max_request_bytes must be 1-{MAX_REQUEST_BYTES_CAP} (1 GiB), got "
                               f"{self.max_request_bytes}")
        self._check_load_bounds()
        if self.request_timeout is not None and not 0 < self.request_timeout < math.inf:
            raise TiermoeError(f"request_timeout must be a finite number of seconds > 0, got {self.request_timeout}")
        for name in ("body_timeout", "keep_alive_timeout"):
            if not 0 < getattr(self, name) < math.inf:
                raise TiermoeError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}")
        if self.watchdog_timeout is not None and not 0 < self.watchdog_timeout < math.inf:
            raise TiermoeError(f"watchdog_timeout must be a finite number of seconds > 0, got {self.watchdog_timeout}")
        object.__setattr__(self, "allowed_origins", tuple(normalise_origin(o) for o in self.allowed_origins))
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().strip("[]").lower() for h in self.allowed_hosts))
        if not is_loopback(self.host) and not self.api_key and not self.allowed_hosts:
            raise TiermoeError(f"--host {self.host} lets other machines reach the server, and without a key anyone of "
                               "them (or a web page, through DNS rebinding) can use it: give --api-key-file PATH (or "
                               "$TIERMOE_API_KEY), or --allowed-hosts NAME,... (the Host names it answers to; '*' to "
                               "answer any, on purpose)")

    def _check_load_bounds(self) -> None:
        running, queued = self.max_running_requests, self.max_queued_requests
        if running > MAX_RUNNING_REQUESTS:
            raise TiermoeError(f"--max-running-requests {running}: at most {MAX_RUNNING_REQUESTS} requests run at once")
        if self.max_total_tokens is not None and running > self.max_total_tokens // MIN_KV_TOKENS_PER_REQUEST:
            raise TiermoeError(f"--max-running-requests {running}: --max-total-tokens {self.max_total_tokens} holds "
                               f"at most {self.max_total_tokens // MIN_KV_TOKENS_PER_REQUEST} running requests (each "
                               f"holds at least {MIN_KV_TOKENS_PER_REQUEST} tokens of KV cache)")
        if queued is not None and queued < 0:
            raise TiermoeError(f"--max-queued-requests must be >= 0, got {queued}")
        room = connection_room()
        if running + (queued or 0) > room:
            flag = "--max-running-requests" if queued is None else "--max-queued-requests"
            raise TiermoeError(f"{flag}: {running + (queued or 0)} requests in flight hold as many connections, but "
                               f"this process may open {open_files_limit()} files (ulimit -n), "
                               f"{FILE_DESCRIPTORS_KEPT} of them kept for the rest: at most {room} in flight")

    @property
    def queue_limit(self) -> int:
        """Requests that may wait beyond the running ones: --max-queued-requests, else QUEUED_BATCHES batches
        (within what the open-file limit leaves)."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return min(QUEUED_BATCHES * self.max_running_requests, connection_room() - self.max_running_requests)

    @property
    def in_flight_limit(self) -> int:
        """Generation requests the server holds at once (running, queued, or being read and tokenised)."""
        return self.max_running_requests + self.queue_limit

    def check_prompt_batch(self, prompts: int) -> None:
        """Refuse a request of more prompts than the server holds at once (a batch in /v1/completions or
        /generate): each of its prompts takes an admission slot (tiermoe.server.admission.take_batch)."""
        if prompts > self.in_flight_limit:
            raise TiermoeError(f"a batch of {prompts} prompts is more than this server holds at once "
                               f"({self.in_flight_limit}: --max-running-requests + --max-queued-requests)")


PLACEMENT_POLICIES = ("static", "kt-dynamic", "adaptive")


@dataclass(frozen=True)
class AdaptiveSettings:
    """The adaptive placement policy's settings (tiermoe.placement.adaptive_policy says what each one does; the
    CLI's --adaptive-* flags set them). Defaults are the ones measured on real routing (BENCHMARKS.md, "Placement
    on real routing")."""

    half_life_tokens: float = 8192.0  # memory of the served workload's estimate (LFU with forgetting)
    replan_every: int = 1  # passes between re-plans
    horizon_tokens: float | None = None  # how long a lasting swap is expected to pay (default: twice the served
    # tokens seen, up to half the half-life: adaptive_policy.HORIZON_PER_TOKEN_SEEN)
    margin: float = 1.0  # swap only when the expected saving exceeds margin x the copies it needs
    max_swaps_in_flight: int = 4  # copy budget, as the caches' default --copy-budget (0: never swaps)
    z_score: float = 2.0  # follow the evidence only this many standard errors past noise
    recent_half_life_tokens: float = 8.0  # the short window: temporal locality decays by lag 4-8
    # a swap may move a GPU slot from one layer to another (the total stays). None: yes with one process; with
    # several ranks only when asked (True), since it changes each rank's per-layer share, which the split across
    # GPUs placed (for_ranks resolves it)
    cross_layer: bool | None = None
    swap_z_score: float = 1.0  # cautious valuation: a lasting swap counts the served rates this many standard
    # errors against it (0: off)
    settled_swap_z_score: float = 0.1  # the same once the longer carry-over check (adaptive_policy.LONG_CHECK_PASSES)
    # has settled and caps what is followed
    prompt_evidence: bool = False  # off: on the ESFT traces it gains nothing (BENCHMARKS.md, cross-layer)
    prompt_weight: float | None = None  # how far a prompt's routing forecasts its decode: None learned, else fixed

    def __post_init__(self):
        positive = {"half_life_tokens": self.half_life_tokens, "recent_half_life_tokens": self.recent_half_life_tokens,
                    "horizon_tokens": self.horizon_tokens if self.horizon_tokens is not None else 1.0}
        at_least_zero = {"margin": self.margin, "z_score": self.z_score, "swap_z_score": self.swap_z_score,
                         "settled_swap_z_score": self.settled_swap_z_score}
        for name, value in positive.items():
            if not (math.isfinite(value) and value > 0):
                raise TiermoeError(f"adaptive setting {name} must be a finite number > 0, got {value}")
        for name, value in at_least_zero.items():
            if not (math.isfinite(value) and value >= 0):
                raise TiermoeError(f"adaptive setting {name} must be a finite number >= 0, got {value}")
        if self.replan_every < 1 or self.max_swaps_in_flight < 0:
            raise TiermoeError(f"adaptive settings replan_every >= 1 and max_swaps_in_flight >= 0 are required, got "
                               f"{self.replan_every} and {self.max_swaps_in_flight}")
        if self.prompt_weight is not None and not 0 <= self.prompt_weight <= 1:
            raise TiermoeError(f"adaptive setting prompt_weight must be between 0 and 1, got {self.prompt_weight}")
        if self.cross_layer not in (None, True, False):
            raise TiermoeError(f"adaptive setting cross_layer must be True, False or None, got {self.cross_layer!r}")

    def for_ranks(self, ranks: int) -> AdaptiveSettings:
        """These settings with `cross_layer` decided for `ranks` GPU ranks: left unset, on with one, off with
        several (their swaps then keep each rank's per-layer share)."""
        if self.cross_layer is not None:
            return self
        return replace(self, cross_layer=ranks == 1)


@dataclass(frozen=True)
class DynamicPlacementConfig:
    """Placement that moves while serving, and layerwise GPU prefill (SGLang-kt names in comments).

    prefill_threshold: prefill batches of at least this many tokens run all their experts on the GPU, CPU-tier
      ones streamed through two buffers within prefill_buffer_gb (--kt-gpu-prefill-token-threshold; the
      threshold alone turns it on). policy: static, kt-dynamic (--kt-enable-dynamic-expert-update: after such a
      batch keep its most-used experts), or adaptive (tiermoe's own: --placement-policy adaptive), with the
      settings `adaptive` (--adaptive-* flags).
    """

    policy: str = "static"
    prefill_threshold: int | None = None
    prefill_buffer_gb: float = 1.0
    adaptive: AdaptiveSettings = field(default_factory=AdaptiveSettings)

    def __post_init__(self):
        if self.policy not in PLACEMENT_POLICIES:
            raise TiermoeError(f"placement policy '{self.policy}' is unknown; choose one of: "
                               f"{', '.join(PLACEMENT_POLICIES)}")
        if self.prefill_threshold is not None and self.prefill_threshold < 1:
            raise TiermoeError(f"prefill_threshold must be >= 1 token, got {self.prefill_threshold}")
        if self.prefill_buffer_gb <= 0:
            raise TiermoeError(f"prefill_buffer_gb must be > 0, got {self.prefill_buffer_gb}")

    @property
    def active(self) -> bool:
        return self.policy != "static" or self.prefill_threshold is not None
