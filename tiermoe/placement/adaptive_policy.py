"""tiermoe's adaptive placement policy: an LFU-like estimate of the served workload, pulled toward the calibration
only as far as the evidence supports it, plus short-window and (optional) prompt terms for the requests being
served, and swaps, within a layer or between layers, only where the cost model says they pay for their copies.

What real routing showed (docs/traces.md, BENCHMARKS.md "cross-task"): a hot set calibrated on another task is
about as good as a random one, an LFU cache that learns the served task within a few hundred tokens beats every
static placement, and what is left beyond that is temporal locality that decays within 4-8 tokens. The previous
policy learned once per 2048 tokens whether to follow the workload at all and lost to LFU by 3-18 hit-rate points.
Since: a GPU slot may move between layers (`cross_layer`, on: +0.3-0.5 points and +0.6-4.5% estimated tokens/s on
the ESFT cross-task pairs), and a lasting swap is valued `swap_z_score` standard errors against it, so near-ties are
not swapped on noise (on a workload like its calibration the previous policy made hundreds of swaps that bought
nothing). Prompt evidence (`prompt_evidence`) is off: it gains nothing on the data we have (BENCHMARKS.md).
The served counts' deviation from the calibration is followed only as far as it carried over to later passes
(out of sample): on a real-size same-task run (8 ESFT law requests side by side, calibrated on 16 others) the
shrinkage alone took the first pass (8 copies of the same first token) and the noise of the next few for a lasting
shift, made 64-111 swaps, mostly in the first 10 passes, and lost 1.5-7.6% of estimated tokens/s to frequency;
with the check it makes none, and on another task it follows within about 30 passes. That check, 4 passes ahead,
also sees a request's own popularity carry over, which does not last beyond the request, so it needed the valuation's
full caution (1 standard error) and left LFU ahead in some ESFT cross-task cells; once a second check, 16 passes
ahead, has enough evidence it caps what the first one follows, and the caution is lighter (`settled_swap_z_score`).
The cap is that check's upper end, so a lasting swap is valued over the whole share between its point estimate and
the cap (lasting_range): at the cap alone the real-size same-task runs made 1-4 swaps at settling that lost 0.1-0.5%
of estimated tokens/s to frequency; the cost is 0.3-1.8% of a +5..+30% lead on the real-size cross-task run.
Legend: L layers, E experts; rates are routed pairs per token.
"""

from __future__ import annotations

import torch

from tiermoe.config import (
    AdaptiveSettings,  # the settings live with the other validated settings
)
from tiermoe.placement.adaptive_forecast import (
    CarryOver,
    Dispersion,
    LastingCheck,
    PromptEvidence,
    shrunk_shares,
    within_pass_dispersion,
)
from tiermoe.placement.pass_cost import PassCostModel
from tiermoe.placement.policies import Swap
from tiermoe.placement.swap_pairing import best_swaps
from tiermoe.placement.tier_balance import PassMix, swap_values

# passes a deviation from the calibration must carry over before it is followed: past the lag at which temporal
# locality fades (4-8, docs/traces.md), in passes so that with many requests side by side it still spans 4 positions
# of each. 4-256 tokens all stop the churn of the real-size same-task run; longer stretches follow another task
# later (256 tokens: 1.5-3 hit-rate points below the unchecked policy on the cross-task pairs, 4: within 0.1)
LASTING_CHECK_PASSES = 4
# ...and once it has been scored LONG_CHECK_SCORED times over the next LONG_CHECK_PASSES passes, that longer check
# caps it (LastingCheck), and a lasting swap is valued at `settled_swap_z_score` rather than `swap_z_score`. A 16-pass
# check alone kept the honest default with a light valuation (0.25) and met the cross-task goal on the ESFT matrix,
# but opened too late for a 128-token decode (3-7% below LFU); settling after 8 forecasts (128 passes) keeps both
LONG_CHECK_PASSES = 16
LONG_CHECK_SCORED = 8
# a lasting swap is valued over this many times the served tokens its forecast rests on (at most half the
# half-life): a forecast from T tokens stands for about as many again before one from twice the evidence replaces
# it. A fixed 4,096 tokens valued the first swaps of a 128-token decode 30x past its end, where what the last few
# tokens routed decides the next ones (the decode traces, BENCHMARKS.md "The horizon follows the evidence")
HORIZON_PER_TOKEN_SEEN = 2.0


class AdaptivePolicy:
    """Follow the served workload as an LFU cache does, but from the calibration, with the requests' prompts and
    recent routing, and only where a swap pays for its copies.

    1. Lasting rate of each expert: decayed routed pairs (`half_life_tokens`) shrunk toward the calibration
       shares (shrunk_shares: evidence decides how far), and of that deviation from the calibration only the
       share u that carried over to the next LASTING_CHECK_PASSES passes, capped by what carried over the next
       LONG_CHECK_PASSES once that longer check has settled (LastingCheck, scored out of sample; the short check
       read at the lower end of its `z_score` interval, 0 until shown, the cap at the upper end of its own; 1
       without a calibration, which leaves nothing to defend). Before any routing it is the calibration; after the
       first pass, before the check can read, that pass's counts shrunk with its own dispersion (_first_pass_rates).
    2. Request rate (`prompt_evidence`): lasting + v x (prompt rate - lasting) over what is left of the running
       requests' decode (PromptEvidence: v learned by scoring each prompt against its decode, 0 until shown).
       Without it, the lasting rate.
    3. Near-term rate over the next `recent_half_life_tokens` tokens: request + w x (recent - request), recent
       from counts decayed over that short window; w in [0, 1] is learned online the same way (0 until shown, so
       a workload without temporal locality is never chased).
    4. What an expert is worth per token on the GPU tier is the step time the cost model (tiermoe.placement.pass_cost)
       gives its move, each layer waiting for its slower tier, over the recent mix of pass sizes (swap_values: what
       promoting it saves, what demoting it costs). A swap (one in, one out) is worth the best of: staying
       (near-term saving over the short window, request saving over the request's rest, lasting saving over the
       horizon (`horizon`) at the low end of lasting_range for what it promotes and the high end for what it demotes,
       less its copies), leaving with the request or after the short window (those savings only, less its copies and
       the copies back). It is made when
       that exceeds `margin` x its copies, best first, at most `max_swaps_in_flight` at once, never on an expert whose
       copy is in flight. Within a layer, or with `cross_layer` between layers (a GPU slot of a cold layer goes to a hot
       expert of another; the total GPU budget stays, swap_pairing.best_swaps).
    Candidates to promote: an expert the last pass used (on demand, as LFU), one the running prompts used once their
    evidence counts (v > 0), or any expert of a layer whose GPU tier is its bottleneck (there the swap that pays
    demotes a hot expert for a cold one).
    """

    name = "adaptive"

    def __init__(self, num_layers: int, num_experts: int, cost: PassCostModel,
                 settings: AdaptiveSettings | None = None, initial_counts_LE: torch.Tensor | None = None):
        self.cost = cost
        self.settings = (settings or AdaptiveSettings()).for_ranks(1)  # cross-layer unless told otherwise
        shape = (num_layers, num_experts)
        self.load_LE = torch.zeros(shape, dtype=torch.float64)  # decayed routed pairs (lasting estimate)
        self._tokens = 0.0
        self.recent_LE = torch.zeros(shape, dtype=torch.float64)  # routed pairs over the short window
        self._recent_tokens = 0.0
        if initial_counts_LE is not None:
            prior = initial_counts_LE.detach().to("cpu", torch.float64).clamp(min=0)
        else:
            prior = torch.ones(shape, dtype=torch.float64)
        totals = prior.sum(dim=1, keepdim=True)
        self.prior_share_LE = torch.where(totals > 0, prior / totals.clamp(min=1e-300), 1.0 / num_experts)
        self._locality = CarryOver(self.settings.recent_half_life_tokens)  # the short window's deviation
        # the served counts' deviation from the calibration, over the next passes (positions of every request);
        # none without a calibration: a uniform prior is nothing to defend (lasting_weight)
        self._lasting_check = (LastingCheck(LASTING_CHECK_PASSES, LONG_CHECK_PASSES, LONG_CHECK_SCORED)
                               if initial_counts_LE is not None else None)
        self.prompts = PromptEvidence(shape)
        self.dispersion = Dispersion(shape)
        self._mix: dict[int, float] = {}  # decayed weight of recent passes by their tokens
        self._passes = 0
        self._lasting: torch.Tensor | None = None  # lasting_rates of the passes seen so far
        self._shares: tuple[torch.Tensor, torch.Tensor] | None = None  # _followed_and_prior of the same passes
        self.last_LE = torch.zeros(shape, dtype=torch.float64)  # the last pass's routed pairs
        self._pending: list[Swap] = []  # swaps proposed and still under way (their experts busy)

    @property
    def horizon(self) -> float:
        """Tokens a lasting swap is expected to pay over: `horizon_tokens` when set, else HORIZON_PER_TOKEN_SEEN
        times the (decayed) served tokens, no less than the short window, no more than half the half-life."""
        s = self.settings
        if s.horizon_tokens is not None:
            return s.horizon_tokens
        grown = max(s.recent_half_life_tokens, HORIZON_PER_TOKEN_SEEN * self._tokens)
        return min(s.half_life_tokens / 2, grown)

    @property
    def recent_weight(self) -> float:
        """w: how much of the short window's deviation carries over it (lower confidence end; 0 until shown)."""
        return self._locality.weight(self.settings.z_score)

    @property
    def lasting_weight(self) -> float:
        """u: how much of the served counts' deviation from the calibration carried over to a later stretch
        (lower confidence end; 0 until shown, so a workload like its calibration never moves). Without a
        calibration, 1: a uniform prior is no placement to defend, and the served counts (shrunk toward it by their
        noise alone) are all the evidence there is."""
        return self._lasting_check.weight(self.settings.z_score) if self._lasting_check is not None else 1.0

    @property
    def swap_z_score(self) -> float:
        """Standard errors a lasting swap counts against it: `swap_z_score` while u rests on the short check (its
        deviation carried over a few passes, not yet checked further), `settled_swap_z_score` once the long check
        caps it. Without a calibration there is no check, and the caution stays."""
        check = self._lasting_check
        return self.settings.settled_swap_z_score if check is not None and check.settled else self.settings.swap_z_score

    @property
    def prompt_weight(self) -> float:
        """v: how much of the prompts' deviation carries over to their decode (0 without prompt_evidence)."""
        s = self.settings
        return self.prompts.weight(s.z_score, s.prompt_weight) if s.prompt_evidence else 0.0

    def observe(self, counts_LE: torch.Tensor, num_tokens: int, is_prefill: bool) -> None:
        if num_tokens <= 0:
            return
        s = self.settings
        counts = counts_LE.detach().to("cpu", torch.float64)
        self._locality.score(counts, num_tokens)
        if self._lasting_check is not None:
            self._lasting_check.score(counts, num_tokens)
        if s.prompt_evidence:
            if is_prefill:  # scored against the lasting rate before the prompt itself moves it
                k_L = counts.sum(dim=1, keepdim=True) / num_tokens
                before = self.lasting_rates() if self._tokens > 0 else self.prior_share_LE * k_L
                self.prompts.on_prefill(counts, num_tokens, before)
            else:
                self.prompts.on_decode(counts, num_tokens)
        decay = 0.5 ** (num_tokens / s.half_life_tokens)
        self._lasting = self._shares = None
        self.load_LE.mul_(decay).add_(counts)
        self.dispersion.add(counts, num_tokens, self.load_LE)
        self._tokens = self._tokens * decay + num_tokens
        short = 0.5 ** (num_tokens / s.recent_half_life_tokens)
        self.recent_LE.mul_(short).add_(counts)
        self._recent_tokens = self._recent_tokens * short + num_tokens
        for key in list(self._mix):
            self._mix[key] *= decay
            if self._mix[key] < 1e-6:
                del self._mix[key]
        self._mix[num_tokens] = self._mix.get(num_tokens, 0.0) + 1.0
        self._passes += 1
        self.last_LE = counts
        if self._lasting_check is not None and self._lasting_check.wants_forecast:
            followed, prior = self._followed_and_prior()
            if not torch.allclose(followed, prior):  # no deviation yet: a forecast of it would teach nothing
                self._lasting_check.open(followed - prior, prior)
        if not self._locality.is_open:
            base = self.request_rates()
            self._locality.open(self.recent_LE / self._recent_tokens - base, base)

    def _followed_and_prior(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed pairs per token [L, E]: the served counts shrunk toward the calibration (shrunk_shares), and the
        calibration itself, at the served pairs per token."""
        if self._shares is None:  # computed once per pass: observe, lasting_rates and lasting_range all read it
            per_layer_k = self.load_LE.sum(dim=1, keepdim=True) / self._tokens
            shares = shrunk_shares(self.load_LE, self.prior_share_LE, self.settings.z_score, self.dispersion.value)
            self._shares = shares * per_layer_k, self.prior_share_LE * per_layer_k
        return self._shares

    def lasting_rates(self) -> torch.Tensor:
        """Forecast routed pairs per token [L, E] of the served workload (the calibration until routing is seen)."""
        if self._tokens <= 0:
            return self.prior_share_LE.clone()  # shares: the ranking is all a placement needs before routing
        if self._lasting is None:  # computed once per pass: propose reads it several times
            followed, prior = self._followed_and_prior()
            if self._passes == 1 and self._lasting_check is not None:
                self._lasting = self._first_pass_rates()
            else:
                self._lasting = prior + self.lasting_weight * (followed - prior)
        return self._lasting.clone()

    def _first_pass_rates(self) -> torch.Tensor:
        """lasting_rates after the first pass, before the carry-over check can have read anything: that pass's counts
        shrunk toward the calibration (shrunk_shares) as far as they depart from it beyond their noise, the noise
        counted with the pass's own within_pass_dispersion. Why not the calibration (u = 0) until the check reads:
        the swaps proposed after the first pass are the first to land, and with the copy budget spent from then on
        they decide a short request. On Qwen3-30B-A3B's 128-token decode trace against the published heat (a
        28-token prompt, tokens 1.4x as alike as independent ones) the first proposal valued at the calibration moved
        GPU slots between layers by the heat and left LFU, which follows the prompt, ahead by 0.5-0.7% at GPU
        ratios 0.1-0.2 (0.1-0.3% with this). Three ESFT law requests side by side open with the same token (2.4x):
        their first pass stays at the calibration, as the honest default needs; a one-token pass counts as
        independent tokens, and its six routed pairs do not depart beyond their noise."""
        alike = within_pass_dispersion(self.load_LE, round(self._tokens), self.prior_share_LE)
        shares = shrunk_shares(self.load_LE, self.prior_share_LE, self.settings.z_score,
                               max(alike, self.dispersion.value))
        return shares * self.load_LE.sum(dim=1, keepdim=True) / self._tokens  # the first pass: load_LE is its counts

    def lasting_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The lowest and highest forecast [L, E] of lasting_rates for u between the long check's point estimate and
        u itself (once settled; before, lasting_rates twice). u reads the long check at the upper end of its
        interval, so as not to undo a real shift for lack of evidence; a swap bought on that reading alone was a bet
        on the served requests' own popularity lasting (the real-size same-task runs: 1-4 swaps at settling that
        lost 0.1-0.5% of estimated tokens/s to frequency, 10-20x their copies). Valued at the low end for what it
        promotes and the high end for what it demotes, a lasting swap must pay for itself over that whole range."""
        lasting = self.lasting_rates()
        check = self._lasting_check
        if check is None or not check.settled or self._tokens <= 0:
            return lasting, lasting
        followed, prior = self._followed_and_prior()
        point = prior + min(self.lasting_weight, check.long.weight(0.0)) * (followed - prior)
        return torch.minimum(lasting, point), torch.maximum(lasting, point)

    def lasting_uncertainty(self) -> torch.Tensor:
        """Standard error [L, E] of lasting_rates: binomial in the served pairs, times the dispersion (a swap
        between two near-tied experts must not be paid for by noise over a long horizon: winner's curse)."""
        if self._tokens <= 0:
            return torch.zeros_like(self.load_LE)
        pairs = self.load_LE.sum(dim=1, keepdim=True)
        rates = self.lasting_rates()
        k_L = pairs / self._tokens
        shares = rates / k_L.clamp(min=1e-300)
        return k_L * (self.dispersion.value * shares * (1 - shares).clamp(min=0) / pairs.clamp(min=1.0)).sqrt()

    def request_rates(self) -> torch.Tensor:
        """Forecast routed pairs per token [L, E] over the rest of the running requests (their prompts' evidence)."""
        lasting = self.lasting_rates()
        if not self.settings.prompt_evidence or self._tokens <= 0:
            return lasting
        return self.prompts.forecast(lasting, self.settings.z_score, self.settings.prompt_weight)

    def rates(self) -> torch.Tensor:
        """Forecast routed pairs per token [L, E] over the next short window."""
        base = self.request_rates()
        if self._recent_tokens <= 0:
            return base
        return (base + self.recent_weight * (self.recent_LE / self._recent_tokens - base)).clamp(min=0.0)

    def mix(self) -> PassMix:
        """The recent passes' sizes, by decayed weight: what one token's share of a pass's time is measured over."""
        return PassMix.from_weights(self._mix)

    def swap_values(self, load_rate_LE: torch.Tensor, mask_LE: torch.Tensor, in_rate_LE: torch.Tensor | None = None,
                    out_rate_LE: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(promote, demote) [L, E] in seconds per token: the step time a CPU-tier expert saves on the GPU tier, and
        the step time a GPU-tier expert would cost on the CPU tier (tier_balance.swap_values: each layer's two
        tiers at `load_rate_LE`, the expert at its own cautious rate), over the recent mix of pass sizes. A layer
        waits for its slower tier (tiers side by side), so where the CPU tier is the bottleneck this is the CPU
        tier's time of the expert, and where the GPU tier is (a GPU slower per expert than the CPU tier: the GPU
        tier on a CPU, `--gpu-profile this-cpu`) promoting costs time and demoting saves it: the swaps then move
        routed pairs off the slower tier until the two balance. (A per-expert difference of the two tiers, never
        below 0, was the value before: it could only keep the starting placement there.)"""
        return swap_values(self.cost, self.mix(), load_rate_LE, mask_LE.to("cpu", torch.bool), in_rate_LE, out_rate_LE)

    def propose(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> list[Swap]:
        s = self.settings
        if self._passes == 0 or self._passes % s.replan_every != 0:
            return []
        budget = s.max_swaps_in_flight - int(busy_LE.sum()) // 2
        if budget <= 0:
            return []
        busy = busy_LE.to("cpu", torch.bool)
        mask = self._target(mask_LE.to("cpu", torch.bool), busy)
        window = min(s.recent_half_life_tokens, self.horizon)
        request = window
        wanted = ~mask & ~busy & (self.last_LE > 0)  # promote on demand: the next token likely reuses it
        if self.prompt_weight > 0 and self.prompts.active:  # the running prompts' experts are wanted too
            request = min(self.horizon, max(window, self.prompts.remaining_tokens()))
            wanted |= ~mask & ~busy & (self.prompts.prompt_rates() > 0)
        rates = self._valuation_rates(request > window)
        values = self._values(rates, mask)
        copies = s.margin * self.cost.copy_seconds(2)
        rest = self.horizon - request
        free = ~busy
        swaps: list[Swap] = []
        # one swap at a time, each valued against the placement the ones before it leave: the two layers a swap
        # touches are valued again (the others do not change), so swaps into one layer stop at its balance
        for _ in range(budget):
            near_in, near_out, lasting_in, lasting_out, req_in, req_out = values
            with_in = window * near_in + (request - window) * req_in
            with_out = window * near_out + (request - window) * req_out
            options = [(with_in + rest * lasting_in, with_out + rest * lasting_out, copies),  # lasting
                       (with_in, with_out, 2 * copies),  # back once the running requests are done
                       (window * near_in, window * near_out, 2 * copies)]  # back after the short window
            # where the GPU tier is a layer's bottleneck (demoting saves time there), any expert of the layer may take
            # a slot: the coldest ones relieve it most, and they are seldom the ones the last pass used
            candidates = ~mask & free & (wanted | (lasting_out < 0).any(dim=1, keepdim=True))
            chosen = best_swaps(options, candidates, mask & free, 1, s.cross_layer)
            if not chosen:
                break
            swap = chosen[0]
            swaps.append(swap)
            mask[swap.layer, swap.expert_in], mask[swap.out_layer, swap.expert_out] = True, False
            free[swap.layer, swap.expert_in] = free[swap.out_layer, swap.expert_out] = False
            rows = sorted({swap.layer, swap.out_layer})
            values[:, rows] = self._values({k: v[..., rows, :] for k, v in rates.items()}, mask[rows])
        self._pending += swaps
        return swaps

    def _valuation_rates(self, with_request: bool) -> dict[str, torch.Tensor]:
        """The rates [K, L, E] the swap values are computed at: each layer's loads, and each expert's own rate when
        promoted or demoted (near term; lasting at both ends of its cautious range; the running requests')."""
        low, high = self.lasting_range()
        spread = self.swap_z_score * self.lasting_uncertainty()
        near, lasting = self.rates(), self.lasting_rates()
        low, high = (low - spread).clamp(min=0.0), high + spread
        loads, own = [near, lasting, lasting], [near, low, high]
        if with_request:
            loads.append(self.request_rates())
            own.append(loads[-1])
        return {"loads": torch.stack(loads), "own": torch.stack(own)}

    def _values(self, rates: dict[str, torch.Tensor], mask_LE: torch.Tensor) -> torch.Tensor:
        """[6, L, E]: near-term promote and demote values, lasting ones, the running requests' ones (0 without).
        A lasting swap is valued at whichever end of each expert's range is worse for it: where the CPU tier is the
        bottleneck that promotes at the low end and demotes at the high end; where the GPU tier is (a slower one), a
        promoted expert costs most at the high end and a demoted one saves least at the low end (valued the other
        way, cold experts were swapped on noise)."""
        promote, demote = self.swap_values(rates["loads"], mask_LE, rates["own"], rates["own"])
        zero = torch.zeros_like(promote[0])
        request = (promote[3], demote[3]) if promote.shape[0] > 3 else (zero, zero)
        return torch.stack([promote[0], demote[0], torch.minimum(promote[1], promote[2]),
                            torch.maximum(demote[1], demote[2]), *request])

    def _target(self, mask_LE: torch.Tensor, busy_LE: torch.Tensor) -> torch.Tensor:
        """The placement once the swaps under way have landed: what the tiers' loads will be. Valued against the
        placement of the moment, a layer half way through its swaps looked as unbalanced as before them, and more
        swaps followed into it (on a slower GPU tier they overshot the balance and swung back)."""
        self._pending = [s for s in self._pending
                         if busy_LE[s.layer, s.expert_in] or busy_LE[s.out_layer, s.expert_out]]
        target = mask_LE.clone()
        for s in self._pending:
            target[s.layer, s.expert_in], target[s.out_layer, s.expert_out] = True, False
        return target
