"""Trace replay: how a placement policy would have done on a recorded per_token trace.

The trace is cut back into its forward passes (which requests shared a batch is kept), and each pass is run
through the policy with its real rules: static strategies never move; KT-compatible dynamic re-selects after
prefill passes of at least `prefill_threshold` tokens (those passes run all their experts on the GPU, the CPU-
tier ones streamed over PCIe); adaptive and the LRU / LFU expert caches swap asynchronously through the live
engine's own swap schedule (tiermoe.placement.swap_schedule: demotion first, then promotion; at most `copy_budget`
swaps under way), their copies landing only after the time they take, so a replay proposes the engine's swaps.
For every pass: GPU hit rate, CPU expert bytes read, bytes copied, swaps, and an estimated time from the cost
model (tiermoe.placement.pass_cost: each MoE layer's two tiers, the streamed copies) that also charges the swap
copies in full (they overlap compute on the GPU, but every byte promoted or demoted also crosses host memory,
whose bandwidth the CPU tier is bound by). Oracles for comparison: Belady's cache with the same copy budget (it
knows the future: a ceiling for caches), the static top-k of the trace itself, and two with hindsight and free
copies (upper bounds): the best placement for the requests running (`oracle-request`: re-chosen whenever a request
joins or leaves; one request at a time, the per-request oracle), and for every window of passes (`oracle-window`,
32 by default: it also sees how routing moves within a request).
Legend: P passes, M MoE layers, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tiermoe.analysis.replay_policies import make_policy
from tiermoe.errors import TiermoeError
from tiermoe.placement.adaptive_policy import AdaptiveSettings
from tiermoe.placement.budget import total_gpu_experts
from tiermoe.placement.cache_policies import DEFAULT_COPY_BUDGET
from tiermoe.placement.global_topk import generate_gpu_experts_masks
from tiermoe.placement.pass_cost import PassCostModel
from tiermoe.placement.pass_traffic import masked_traffic, pass_traffic
from tiermoe.placement.policies import Swap
from tiermoe.placement.strategies import STRATEGIES, TIME_BALANCED, place
from tiermoe.placement.swap_schedule import SWAP_EXPERTS_IN_FLIGHT, SwapSchedule
from tiermoe.stats.sglang_records import from_records, is_records_file

DYNAMIC = ("kt-dynamic", "lru", "lfu", "adaptive", "belady")
ORACLES = ("belady", "oracle-static", "oracle-request", "oracle-window")
REPLAY_POLICIES = STRATEGIES + (TIME_BALANCED,) + DYNAMIC + ORACLES[1:]


@dataclass(frozen=True)
class TracePasses:
    counts_PME: torch.Tensor  # int64 routed pairs per pass, MoE layer and expert
    tokens_P: torch.Tensor  # tokens in each pass
    prefill_P: torch.Tensor  # bool: the pass prefilled (any prompt token)
    decode_tokens_P: torch.Tensor  # decode tokens in each pass (= output tokens it produced)
    moe_layers: tuple[int, ...]
    num_layers: int
    num_experts: int
    request_runs_P: torch.Tensor | None = None  # int64: runs of passes with the same requests (None: not recorded)

    @property
    def num_passes(self) -> int:
        return self.counts_PME.shape[0]

    def total_LE(self) -> torch.Tensor:
        """All routed pairs as [L, E] (dense rows zero)."""
        out = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        out[list(self.moe_layers)] = self.counts_PME.sum(dim=0).double()
        return out


RECORD_ONE = "record one with `tiermoe record --mode per_token`"


def _tensor(trace: dict, key: str, dims: int, integer: bool = True) -> torch.Tensor:
    value = trace[key]
    if not isinstance(value, torch.Tensor) or value.dim() != dims or value.is_complex() or (
            integer and (value.is_floating_point() or value.dtype == torch.bool)):
        kind = "integer" if integer else "boolean"
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise TiermoeError(f"not a per_token trace: {key} must be a {dims}-D {kind} tensor, got {got}")
    return value


def _count(trace: dict, key: str) -> int:
    value = trace[key]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TiermoeError(f"not a per_token trace: {key} must be a positive integer, got {value!r}")
    return value


def _checked_trace(trace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[int, ...],
                                   int, int]:
    """The fields replay reads, each checked against the format (a file that is not a trace is one line);
    token_request may be missing (None: no per-request oracle)."""
    if not isinstance(trace, dict):
        raise TiermoeError(f"not a per_token trace: the file holds a {type(trace).__name__}, not a dict; {RECORD_ONE}")
    try:
        pass_N = _tensor(trace, "token_pass", 1).long()
        ids_NMK = _tensor(trace, "topk_ids", 3).long()
        prefill_N = _tensor(trace, "token_is_prefill", 1, integer=False).bool()
        request_N = _tensor(trace, "token_request", 1).long() if "token_request" in trace else None
        layers = trace["moe_layers"]
        num_layers, num_experts = _count(trace, "num_layers"), _count(trace, "num_experts")
    except KeyError as err:
        raise TiermoeError(f"not a per_token trace: missing {err}; {RECORD_ONE}") from None
    try:
        moe_layers = tuple(int(x) for x in layers)
    except (TypeError, ValueError):
        raise TiermoeError("not a per_token trace: moe_layers must be a list of layer indices") from None
    n, m = ids_NMK.shape[0], ids_NMK.shape[1]
    if pass_N.shape[0] != n or prefill_N.shape[0] != n or (request_N is not None and request_N.shape[0] != n):
        rows = "" if request_N is None else f", token_request [{request_N.shape[0]}]"
        raise TiermoeError(f"not a per_token trace: token_pass [{pass_N.shape[0]}], token_is_prefill "
                           f"[{prefill_N.shape[0]}]{rows} and topk_ids [{n}, ...] must have one row per token")
    if len(moe_layers) != m or any(not 0 <= layer < num_layers for layer in moe_layers):
        raise TiermoeError(f"not a per_token trace: moe_layers {list(moe_layers)[:8]} must name topk_ids' {m} MoE "
                           f"layers, each in 0..{num_layers - 1}")
    if n and (int(ids_NMK.min()) < -1 or int(ids_NMK.max()) >= num_experts):
        raise TiermoeError(f"not a per_token trace: topk_ids hold {int(ids_NMK.min())}..{int(ids_NMK.max())}; "
                           f"expected expert ids 0..{num_experts - 1} (or -1)")
    return pass_N, ids_NMK, prefill_N, request_N, moe_layers, num_layers, num_experts


def trace_passes(trace: dict) -> TracePasses:
    """Per-pass routing of a per_token trace (tiermoe.stats.traces format, or SGLang's per_token records)."""
    if is_records_file(trace):
        trace = from_records(trace, "the trace")
    pass_N, ids_NMK, prefill_N, request_N, moe_layers, num_layers, num_experts = _checked_trace(trace)
    if pass_N.numel() == 0:
        raise TiermoeError("the trace holds no tokens")
    # passes numbered 0.. in order; a recorded trace has no gaps, and a forged one cannot make the tables huge
    pass_N = torch.unique(pass_N, return_inverse=True)[1]
    num_passes, m = int(pass_N.max()) + 1, ids_NMK.shape[1]
    valid = ids_NMK >= 0
    flat = (pass_N[:, None, None] * m + torch.arange(m)[None, :, None]) * num_experts + ids_NMK.clamp(min=0)
    counts = torch.bincount(flat[valid], minlength=num_passes * m * num_experts)
    tokens = torch.bincount(pass_N, minlength=num_passes)
    runs = request_runs(pass_N, request_N, num_passes) if request_N is not None else None
    return TracePasses(
        counts_PME=counts.reshape(num_passes, m, num_experts), tokens_P=tokens,
        prefill_P=torch.bincount(pass_N[prefill_N], minlength=num_passes) > 0,
        decode_tokens_P=torch.bincount(pass_N[~prefill_N], minlength=num_passes),
        moe_layers=moe_layers, num_layers=num_layers, num_experts=num_experts, request_runs_P=runs)


def request_runs(pass_N: torch.Tensor, request_N: torch.Tensor, num_passes: int) -> torch.Tensor:
    """[P] int64: the run each pass belongs to, a new run starting at every pass whose set of requests differs from
    the previous pass's (passes numbered 0..P-1, every one holding a token)."""
    request_N = torch.unique(request_N, return_inverse=True)[1]  # 0..R-1: pass x R + request cannot overflow
    r = int(request_N.max()) + 1
    pairs = torch.unique(pass_N * r + request_N)  # every (pass, request) once, sorted by pass
    sets = [x.tolist() for x in torch.split(pairs % r, torch.bincount(pairs // r, minlength=num_passes).tolist())]
    new_run = [p == 0 or sets[p] != sets[p - 1] for p in range(num_passes)]
    return torch.cumsum(torch.tensor(new_run, dtype=torch.int64), 0) - 1


@dataclass
class ReplayResult:
    policy: str
    gpu_ratio: float
    hit_rate_P: list[float] = field(default_factory=list)
    cpu_bytes_P: list[int] = field(default_factory=list)
    copied_bytes_P: list[int] = field(default_factory=list)
    swaps_P: list[int] = field(default_factory=list)
    time_P: list[float] = field(default_factory=list)
    pairs: int = 0
    gpu_pairs: int = 0
    output_tokens: int = 0
    swap_log: list[tuple[int, Swap]] = field(default_factory=list)  # (pass, swap) as the policy's were accepted

    @property
    def hit_rate(self) -> float:
        return self.gpu_pairs / self.pairs if self.pairs else 0.0

    @property
    def time(self) -> float:
        return sum(self.time_P)

    @property
    def bytes_copied(self) -> int:
        return sum(self.copied_bytes_P)

    def summary(self) -> dict:
        return {"policy": self.policy, "gpu_ratio": self.gpu_ratio, "hit_rate": self.hit_rate,
                "estimated_seconds": self.time, "cpu_bytes": sum(self.cpu_bytes_P), "bytes_copied": self.bytes_copied,
                "swaps": sum(self.swaps_P), "output_tokens": self.output_tokens,
                "estimated_output_tokens_per_s": self.output_tokens / self.time if self.time else None}


def _initial_mask(policy: str, passes: TracePasses, total: int, calibration_LE, seed: int,
                  cost_model: PassCostModel) -> torch.Tensor:
    rows = torch.zeros(passes.num_layers, dtype=torch.bool)
    rows[list(passes.moe_layers)] = True
    if policy == "oracle-static":
        return generate_gpu_experts_masks(passes.total_LE(), total)[list(passes.moe_layers)]
    calibrated = "frequency" if calibration_LE is not None else "uniform"
    # adaptive starts where the step time is least (time-balanced: frequency's mask where the CPU tier is the slower)
    strategy = {"kt-dynamic": "uniform", "adaptive": TIME_BALANCED if calibration_LE is not None else "uniform",
                "lru": calibrated, "lfu": calibrated, "belady": calibrated, "oracle-window": "uniform",
                "oracle-request": "uniform"}.get(policy, policy)
    return place(strategy, rows, passes.num_experts, total, calibration_LE, seed, cost=cost_model,
                 tokens_per_pass=decode_batch(passes), pairs_per_token=pairs_per_token(passes))[list(passes.moe_layers)]


def decode_batch(passes: TracePasses) -> float:
    """Tokens of a typical decode pass (the batch the server runs; what a time-balanced placement is chosen for)."""
    decode = passes.tokens_P[~passes.prefill_P]
    return float(decode.double().mean()) if decode.numel() else 1.0


def pairs_per_token(passes: TracePasses) -> float:
    """Routed pairs per token and MoE layer: the model's top-k (less any dropped slots)."""
    tokens = int(passes.tokens_P.sum()) * len(passes.moe_layers)
    return float(passes.counts_PME.sum()) / tokens if tokens else 1.0


class TimedCopy:
    """A copy in a replay: it lands once the passes after its start have taken `seconds`."""

    def __init__(self, seconds: float):
        self.left = seconds

    def landed(self) -> bool:
        return self.left <= 0


class ReplayedSwaps:
    """The live engine's swap schedule (tiermoe.placement.swap_schedule, the object PlacementManager runs) with
    copies timed by the cost model: after each pass the copies that have landed flip their entries of `mask_ME`,
    the policy proposes, and copies start (demotion first, then promotion), each landing once the passes after its
    start have taken as long as it takes (in the background, as the engine's copies run: a replay never waits for
    one). max_in_flight: copies at once, the engine's SWAP_EXPERTS_IN_FLIGHT (every policy keeps at most its copy
    budget of swaps under way, one copy each at a time, so with a budget of 4 the limit never binds; a larger budget
    raises it to match)."""

    def __init__(self, mask_ME: torch.Tensor, copy_seconds: float, max_in_flight: int | None = SWAP_EXPERTS_IN_FLIGHT):
        self.mask_ME = mask_ME
        self.copy_seconds = copy_seconds
        self.schedule = SwapSchedule(max_in_flight)

    def advance(self, seconds: float) -> None:
        """A pass of `seconds` has run: the copies under way progress."""
        for c in self.schedule.in_flight:
            c.ticket.left -= seconds

    def busy(self) -> torch.Tensor:
        return self.schedule.busy(*self.mask_ME.shape)

    def after_pass(self, policy) -> tuple[list[Swap], int]:
        """Land, propose, start: (the swaps accepted from the policy, copies started)."""
        for c in self.schedule.landed():
            self.mask_ME[c.layer, c.expert] = c.to_gpu
            self.schedule.after_landing(c)
        busy = self.busy()
        accepted = self.schedule.accept(policy.propose(self.mask_ME, busy), busy)
        copies = []
        def in_place(s: Swap) -> bool:  # expert_out still on the GPU tier, expert_in still on the CPU tier
            return bool(self.mask_ME[s.out_layer, s.expert_out]) and not bool(self.mask_ME[s.layer, s.expert_in])

        def start(swap: Swap, layer: int, expert: int, to_gpu: bool) -> TimedCopy:
            copies.append(1)
            return TimedCopy(self.copy_seconds)

        self.schedule.start(in_place, start)
        return accepted, len(copies)


def replay(trace: dict | TracePasses, policy: str, gpu_ratio: float, cost_model: PassCostModel,
           calibration_LE: torch.Tensor | None = None, prefill_threshold: int | None = None,
           adaptive: AdaptiveSettings | None = None, window: int = 32, seed: int = 42,
           copy_budget: int = DEFAULT_COPY_BUDGET) -> ReplayResult:
    """Replay `trace` pass by pass through `policy` at `gpu_ratio` of the routed experts on the GPU tier.

    calibration_LE: statistics [L, E] for frequency / balanced (and adaptive's starting point), from another
    part of the workload; adaptive starts from time-balanced on it. prefill_threshold: layerwise GPU prefill for the
    dynamic policies. copy_budget: swaps the caches (lru, lfu, belady) may have under way.
    """
    if policy not in REPLAY_POLICIES:
        raise TiermoeError(f"unknown replay policy '{policy}'; choose one of: {', '.join(REPLAY_POLICIES)}")
    passes = trace if isinstance(trace, TracePasses) else trace_passes(trace)
    m, e = len(passes.moe_layers), passes.num_experts
    total = total_gpu_experts(m, e, ratio=gpu_ratio)
    mask_ME = _initial_mask(policy, passes, total, calibration_LE, seed, cost_model)
    if policy == "kt-dynamic" and prefill_threshold is None:  # it follows layerwise prefill only: it never moves
        return _replay_static(passes, policy, gpu_ratio, mask_ME, cost_model, total, window)
    if policy in DYNAMIC:
        prior = calibration_LE[list(passes.moe_layers)] if calibration_LE is not None else None
        dyn = make_policy(policy, passes.counts_PME, cost_model, prior, prefill_threshold, adaptive, copy_budget)
        in_flight = max(SWAP_EXPERTS_IN_FLIGHT, copy_budget, adaptive.max_swaps_in_flight if adaptive else 0)
        return _replay_dynamic(passes, policy, gpu_ratio, mask_ME, cost_model, dyn, prefill_threshold, in_flight)
    return _replay_static(passes, policy, gpu_ratio, mask_ME, cost_model, total, window)


def _replay_static(passes: TracePasses, policy: str, gpu_ratio: float, mask_ME: torch.Tensor,
                   cost_model: PassCostModel, total: int, window: int) -> ReplayResult:
    """A placement that copies nothing: a static strategy, or an oracle (oracle-window re-places for free every
    `window` passes, oracle-request at every run of passes with the same requests). All passes at once."""
    num_p = passes.num_passes
    mask_PME = mask_ME[None].expand(num_p, -1, -1).clone()
    if policy in ("oracle-window", "oracle-request"):
        for start, end in _oracle_windows(passes, policy, window):
            upcoming = passes.counts_PME[start:end].sum(dim=0).double()
            mask_PME[start:end] = generate_gpu_experts_masks(upcoming, total)
    traffic = masked_traffic(passes.counts_PME, mask_PME)
    pairs_P = (traffic.cpu_pairs_PM + traffic.gpu_pairs_PM).sum(-1)
    gpu_pairs_P = traffic.gpu_pairs_PM.sum(-1)
    result = ReplayResult(policy, gpu_ratio)
    result.hit_rate_P = (gpu_pairs_P.double() / pairs_P.clamp(min=1).double()).tolist()
    result.cpu_bytes_P = (traffic.cpu_distinct_PM.sum(-1) * cost_model.model.bytes_per_expert).tolist()
    result.copied_bytes_P = [0] * num_p
    result.swaps_P = [0] * num_p
    result.time_P = cost_model.moe_seconds_P(traffic, passes.tokens_P).tolist()
    result.pairs, result.gpu_pairs = int(pairs_P.sum()), int(gpu_pairs_P.sum())
    result.output_tokens = int(passes.decode_tokens_P.sum()) + int(passes.prefill_P.sum())
    return result


def _oracle_windows(passes: TracePasses, policy: str, window: int) -> list[tuple[int, int]]:
    """The [start, end) pass ranges an oracle places for: every `window` passes, or every run of passes with the
    same requests."""
    num_p = passes.num_passes
    if policy == "oracle-window":
        return [(start, min(num_p, start + window)) for start in range(0, num_p, window)]
    if passes.request_runs_P is None:
        raise TiermoeError("oracle-request needs the trace's requests (token_request, one per token); this trace "
                           "has none: replay oracle-window instead")
    ends = torch.cumsum(torch.bincount(passes.request_runs_P), 0).tolist()
    return list(zip([0] + ends[:-1], ends))


def _replay_dynamic(passes: TracePasses, policy: str, gpu_ratio: float, mask_ME: torch.Tensor,
                    cost_model: PassCostModel, dyn, prefill_threshold: int | None,
                    max_in_flight: int = SWAP_EXPERTS_IN_FLIGHT) -> ReplayResult:
    """A dynamic policy (tiermoe.analysis.replay_policies), pass by pass, through the live engine's swap schedule
    (ReplayedSwaps): each copy is charged in full to the pass that starts it, and lands once the passes after its
    start have taken as long. `swap_log` keeps every accepted swap with its pass."""
    result = ReplayResult(policy, gpu_ratio)
    swaps_in = ReplayedSwaps(mask_ME, cost_model.copy_seconds(), max_in_flight)
    bpe = cost_model.model.bytes_per_expert
    for p in range(passes.num_passes):
        counts_ME = passes.counts_PME[p]
        tokens = int(passes.tokens_P[p])
        layerwise = prefill_threshold is not None and bool(passes.prefill_P[p]) and tokens >= prefill_threshold
        # layerwise: every CPU-tier expert the pass routes to crosses PCIe and runs on the GPU
        traffic = pass_traffic(counts_ME, mask_ME, layerwise)
        seconds = float(cost_model.moe_seconds_P(traffic, passes.tokens_P[p:p + 1])[0])
        cpu_pairs, gpu_pairs = int(traffic.cpu_pairs_PM.sum()), int(traffic.gpu_pairs_PM.sum())
        copied = int(traffic.streamed_P.sum()) * bpe
        result.gpu_pairs += gpu_pairs
        result.pairs += cpu_pairs + gpu_pairs
        result.output_tokens += int(passes.decode_tokens_P[p]) + int(bool(passes.prefill_P[p]))
        swaps_in.advance(seconds)
        dyn.observe(counts_ME, tokens, bool(passes.prefill_P[p]))
        if layerwise:  # KT: the chosen experts are already on the GPU in the streamed layer: no copies
            accepted = dyn.propose(mask_ME, swaps_in.busy())
            for swap in accepted:
                mask_ME[swap.layer, swap.expert_in], mask_ME[swap.out_layer, swap.expert_out] = True, False
            copies = 0
        else:
            accepted, copies = swaps_in.after_pass(dyn)
        result.swap_log += [(p, swap) for swap in accepted]
        copied += copies * bpe
        seconds += copies * cost_model.copy_seconds()  # charged in full, although it overlaps compute
        result.hit_rate_P.append(gpu_pairs / max(1, cpu_pairs + gpu_pairs) if not layerwise else 1.0)
        result.cpu_bytes_P.append(int(traffic.cpu_distinct_PM.sum()) * bpe)
        result.copied_bytes_P.append(copied)
        result.swaps_P.append(len(accepted))
        result.time_P.append(seconds)
    return result
