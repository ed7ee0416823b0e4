"""The adaptive policy's forecasts: how far to trust the served counts over the calibration (shrunk_shares), how much
of a deviation carries over to later passes, scored out of sample (CarryOver, PersistenceFit, LastingCheck), and the
prompts being served as a forecast of their decode (PromptEvidence).

Why the prompt: on real routing (docs/traces.md, BENCHMARKS.md "cross-task") per-request popularity dominates: a
hot set calibrated on another task is about as good as a random one, and a per-request oracle beats the best
pooled set by about 20 points. A request's prefill pass routes all of its prompt's tokens, so it is the first and
largest sample of that request's routing, available before its first decode step.
Legend: L layers, E experts; rates are routed pairs per token.
"""

from __future__ import annotations

import copy
from collections import deque

import torch


class PersistenceFit:
    """One regression slope through the origin, target on regressor, read at the lower end of its confidence
    interval: how much of a deviation carries over, counted only once the evidence says so. In [0, 1].

    The slope's variance is taken as were there nothing to carry (sum of (x y)^2), or with `residual` from what
    the slope leaves unexplained (sum of x^2 (y - slope x)^2, the sandwich estimate): the same while nothing
    carries over, but it does not count a deviation that plainly carries as noise, so the lower end approaches
    the slope instead of staying below it by the deviation's own spread."""

    def __init__(self, residual: bool = False):
        self.residual = residual
        self.cov = self.var = self.noise = 0.0
        self._x3y = self._x4 = 0.0  # for the residual variance: sum x^3 y and sum x^4

    def add(self, regressor: torch.Tensor, target: torch.Tensor) -> None:
        self.cov += float((regressor * target).sum())
        self.var += float((regressor * regressor).sum())
        self.noise += float((regressor * target).pow(2).sum())  # variance of cov were there nothing to carry
        if self.residual:
            self._x3y += float((regressor.pow(3) * target).sum())
            self._x4 += float(regressor.pow(4).sum())

    def slope(self, z_score: float) -> float:
        """The slope at the lower end of its `z_score` interval (a negative z_score: the upper end), in [0, 1]."""
        if self.var <= 0:
            return 0.0
        b = self.cov / self.var
        spread = self.noise - 2 * b * self._x3y + b * b * self._x4 if self.residual else self.noise
        return min(1.0, max(0.0, b - z_score * max(spread, 0.0) ** 0.5 / self.var))


class CarryOver:
    """How much of a deviation from a base forecast carries over to a later, disjoint stretch of passes (out of
    sample: the stretch's routing played no part in the deviation), as a PersistenceFit slope. The stretch is
    `stretch` tokens, or passes with `in_passes` (a pass is one more position of every request decoding, whatever
    the batch). One forecast is open at a time (overlapping ones would overstate the evidence): opened with the
    deviation and the base it departs from, scored against the routed pairs per token of the passes after it."""

    def __init__(self, stretch: float, in_passes: bool = False, residual: bool = False):
        self.stretch, self.in_passes = stretch, in_passes
        self.fit = PersistenceFit(residual)
        self.scored = 0  # forecasts scored so far
        self._open: list | None = None  # [deviation, base, counts, tokens, stretch so far]

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def open(self, deviation_LE: torch.Tensor, base_LE: torch.Tensor) -> None:
        self._open = [deviation_LE, base_LE, torch.zeros_like(base_LE), 0.0, 0.0]

    def score(self, counts_LE: torch.Tensor, num_tokens: int) -> None:
        """A pass served after the open forecast (call it before the pass moves the next forecast)."""
        if self._open is None:
            return
        self._open[2] += counts_LE
        self._open[3] += num_tokens
        self._open[4] += 1 if self.in_passes else num_tokens
        if self._open[4] >= self.stretch:
            deviation, base, counts, tokens, _ = self._open
            self.fit.add(deviation, counts / tokens - base)
            self.scored += 1
            self._open = None

    def weight(self, z_score: float, with_open: bool = False) -> float:
        """The carried share, at the lower end of its `z_score` interval: 0 until the evidence shows it. `with_open`:
        the open forecast counts too, scored on the passes seen so far (a sequential reading: a short stretch is a
        noisy target, which widens the interval by itself, so a deviation that carries over plainly shows before
        the stretch ends, and one that does not stays at 0)."""
        if with_open and self._open is not None and self._open[3] > 0:
            deviation, base, counts, tokens, _ = self._open
            fit = copy.copy(self.fit)  # floats only: the running fit stays as it is
            fit.add(deviation, counts / tokens - base)
            return fit.slope(z_score)
        return self.fit.slope(z_score)


# the share of the deviation the first forecast must carry, at the lower end of its interval, before its sequential
# reading is taken (LastingCheck.weight): Qwen3-30B-A3B's decode trace against the published heat carries 0.65-0.78
# of it over its first passes; three ESFT law requests side by side, calibrated on their own counts, carry 0.05-0.12
# (their prompts' shared template, which routes alike for a few positions and fades), and following that early cost
# 0.3% of estimated time against uniform on this CPU's tiers
PLAIN_CARRY = 0.5


class LastingCheck:
    """How much of the served counts' deviation from the calibration lasts, as two CarryOver checks of the same
    deviations: over the next `short` passes, and over the next `long` ones. The short check decides (at the lower
    end of its interval); once the long one has scored `settle_after` forecasts (`settled`) it caps that share at
    the upper end of its own interval. Why both: the short check opens within a few dozen passes, which a short
    workload needs (a 128-token decode calibrated on another workload's heat), but it also sees a request's own
    popularity carry over, which does not last beyond the request; the long one tells the two apart, but only after
    `long` x `settle_after` passes, and with fewer forecasts, so a wide interval. Read at its lower end it would undo
    a real shift for lack of evidence (on the real-size cross-task run, 8 requests side by side: u 0.73 -> 0.40 at
    settling, 1-2% of estimated tokens/s lost); as a cap it lowers the share only where it shows the carry fades."""

    def __init__(self, short: int, long: int, settle_after: int):
        self.short = CarryOver(short, in_passes=True, residual=True)
        self.long = CarryOver(long, in_passes=True, residual=True)
        self.settle_after = settle_after

    @property
    def settled(self) -> bool:
        return self.long.scored >= self.settle_after

    def score(self, counts_LE: torch.Tensor, num_tokens: int) -> None:
        self.short.score(counts_LE, num_tokens)
        self.long.score(counts_LE, num_tokens)

    @property
    def wants_forecast(self) -> bool:
        return not (self.short.is_open and self.long.is_open)

    def open(self, deviation_LE: torch.Tensor, base_LE: torch.Tensor) -> None:
        """Each check that has none open takes this deviation as its next forecast."""
        for check in (self.short, self.long):
            if not check.is_open:
                check.open(deviation_LE, base_LE)

    def weight(self, z_score: float) -> float:
        """The share that lasts: the short check's at the lower end of its `z_score` interval, once settled no more
        than the long check's at the upper end of its own. Until the short check has scored its first forecast it
        reads that one sequentially, on the passes seen so far (CarryOver.weight with_open): a request that departs
        plainly from its calibration is followed from its second pass rather than its fifth. What a short decode
        needs: on the 128-token Qwen3-30B-A3B trace, calibrated on another workload's heat, the first swaps decide
        the request (est. tokens/s against LFU at 0.6 / 0.7 on the H200: -0.76 / -1.55% waiting for the first score,
        +2.98 / +2.63% reading it sequentially); later forecasts are scored as before, so a long run is unchanged.
        The early reading counts only where it says the request departs plainly (PLAIN_CARRY)."""
        if self.short.scored == 0:
            early = self.short.weight(z_score, with_open=True)
            return early if early >= PLAIN_CARRY else 0.0
        short = self.short.weight(z_score)
        return min(short, self.long.weight(-z_score)) if self.settled else short


def shrunk_shares(counts_LE: torch.Tensor, prior_share_LE: torch.Tensor, z_score: float,
                  dispersion: float = 1.0) -> torch.Tensor:
    """Each layer's routing shares: the served counts pulled toward the prior, James-Stein style, by as many
    pseudo-pairs as the evidence warrants. The squared distance between served and prior shares is noise
    D (1 - sum s^2) / N plus the real difference (D the dispersion: 1 for independent tokens, more when a
    request's tokens route alike, see Dispersion); with the real difference d estimated (less z standard errors
    of the noise term), the prior weighs D (1 - sum s^2) / d pairs: all the weight while nothing shows a
    difference (a workload that matches its calibration never moves), little once another task is plainly being
    served."""
    pairs = counts_LE.sum(dim=1, keepdim=True)
    shares = counts_LE / pairs.clamp(min=1e-300)
    spread = dispersion * (1.0 - (shares * shares).sum(dim=1, keepdim=True))
    noise = spread / pairs.clamp(min=1.0)
    distance = ((shares - prior_share_LE) ** 2).sum(dim=1, keepdim=True)
    difference = distance - noise * (1.0 + z_score * (2.0 / max(1, counts_LE.shape[1] - 1)) ** 0.5)
    weight = torch.where(difference > 0, spread / difference.clamp(min=1e-300), torch.full_like(pairs, 1e300))
    return (counts_LE + weight * prior_share_LE) / (pairs + weight)


class Dispersion:
    """How much more the served shares vary than independent tokens would make them (>= 1): consecutive tokens of
    one request route alike (per-request popularity), so N routed pairs carry the evidence of N / D independent
    ones. Measured on blocks of `block_tokens` tokens: each layer's chi-square of the block's counts against the
    served shares, over its degrees of freedom (1 in expectation were tokens independent), averaged over layers
    and (decayed) over blocks. A slow drift of the workload counts too, which only makes the policy slower to
    follow it."""

    def __init__(self, shape: tuple[int, int], block_tokens: int = 256, memory: float = 0.95):
        self.block_tokens, self.memory = block_tokens, memory
        self._block_LE = torch.zeros(shape, dtype=torch.float64)
        self._tokens = 0
        self._sum = self._blocks = 0.0

    @property
    def value(self) -> float:
        return max(1.0, self._sum / self._blocks) if self._blocks else 1.0

    def add(self, counts_LE: torch.Tensor, num_tokens: int, served_LE: torch.Tensor) -> None:
        self._block_LE += counts_LE
        self._tokens += num_tokens
        if self._tokens < self.block_tokens:
            return
        pairs = self._block_LE.sum(dim=1, keepdim=True)
        shares = served_LE / served_LE.sum(dim=1, keepdim=True).clamp(min=1e-300)
        expected = pairs * shares
        seen = expected > 0
        chi2 = torch.where(seen, (self._block_LE - expected) ** 2 / expected.clamp(min=1e-300), 0.0).sum(dim=1)
        dof = (seen.sum(dim=1) - 1).clamp(min=1)
        layers = pairs.flatten() > 0
        if layers.any():
            self._sum = self.memory * self._sum + float((chi2 / dof)[layers].mean())
            self._blocks = self.memory * self._blocks + 1.0
        self._block_LE.zero_()
        self._tokens = 0


def within_pass_dispersion(counts_LE: torch.Tensor, num_tokens: int, share_LE: torch.Tensor) -> float:
    """How much more alike the tokens of one pass route than independent tokens at `share_LE` would (>= 1): the
    squared counts over their expectation, sum over e of (n pi_e (1 - pi_e) + n^2 pi_e^2) with pi_e = k share_e
    each token's chance of routing to e. Tokens that all route alike (the same first token of requests side by
    side) give about n; a pass of one token gives 1."""
    counts = counts_LE.to(torch.float64)
    per_token = share_LE * counts.sum(dim=1, keepdim=True) / num_tokens
    expected = float(counts.sum() + num_tokens * (num_tokens - 1) * (per_token * per_token).sum())
    return max(1.0, float((counts * counts).sum()) / expected) if expected > 0 else 1.0


class PromptEvidence:
    """The prompts of the requests being decoded, as a forecast of their decode routing.

    - Which prompts: the last `n` prefill passes, n the tokens of the latest decode pass (one token per running
      request), so with one request at a time it is that request's prompt alone, and a batch of 8 keeps 8.
    - The forecast: lasting + w x (prompt rate - typical prompt rate), the prompt rate being the mean of the kept
      prompts' routed pairs per token, the typical one a decayed mean over the earlier prompts (the lasting rate
      for the very first). Measured against the typical prompt, not the lasting rate: on the ESFT traces every
      prompt shares a template and prompts route unlike answers, so prompt - lasting predicted the answer
      backwards (slope -0.47 on law -> intent). w in [0, 1] is learned (PersistenceFit): each prompt's deviation
      is scored against what the decode passes after it routed, up to the next prefill; read at the lower end of
      its `z_score` interval, so it is 0 until shown and a workload whose prompts do not predict their answers is
      never chased. A fixed w (AdaptiveSettings.prompt_weight, in [0, 1]) skips the learning.
    - How long it lasts: the decode tokens served between prefill passes, averaged (decayed); the forecast is
      expected to hold for what is left of that after the decode tokens since the last prefill.
    A pass that prefills anything counts as a prompt (a chunked pass mixing decode tokens in slightly dilutes it).
    """

    def __init__(self, shape: tuple[int, int], default_decode_tokens: float = 64.0, memory: float = 0.9):
        self._prompts: deque[torch.Tensor] = deque()  # per-token rates [L, E] of each recent prompt, newest last
        self._mean_prompt: torch.Tensor | None = None  # the typical prompt's rates (decayed mean over prompts)
        self._first_lasting: torch.Tensor | None = None  # the lasting rate when the first prompt came
        self._running = 1  # requests decoding, from the latest decode pass
        self.fit = PersistenceFit()
        self._open: list | None = None  # [deviation, lasting, decode counts, decode tokens] awaiting its decode
        self._decode_sum, self._gaps, self._memory = default_decode_tokens, 1.0, memory
        self.decode_since_prefill = 0.0
        self._shape = shape

    @property
    def active(self) -> bool:
        return bool(self._prompts)

    def mean_decode_tokens(self) -> float:
        """Decode tokens served between two prefill passes, on average (decayed over the recent gaps)."""
        return self._decode_sum / self._gaps

    def remaining_tokens(self) -> float:
        return max(0.0, self.mean_decode_tokens() - self.decode_since_prefill)

    def prompt_rates(self) -> torch.Tensor:
        kept = list(self._prompts)[-self._running:]
        return torch.stack(kept).mean(dim=0)

    def deviation(self) -> torch.Tensor:
        """How the running prompts differ from the typical prompt: what is particular to these requests (a
        template every prompt shares, or prompts routing unlike answers, is no evidence about one request).
        Before a second prompt there is no typical one: the first is measured against the lasting rate."""
        return self.prompt_rates() - (self._mean_prompt if self._mean_prompt is not None else self._first_lasting)

    def on_prefill(self, counts_LE: torch.Tensor, num_tokens: int, lasting_LE: torch.Tensor) -> None:
        self._close()
        if self.decode_since_prefill > 0:  # a gap between prefills ended: learn how long a prompt's answer runs
            self._decode_sum = self._memory * self._decode_sum + self.decode_since_prefill
            self._gaps = self._memory * self._gaps + 1.0
        self.decode_since_prefill = 0.0
        rates = counts_LE / num_tokens
        if self._prompts:  # the typical prompt: all before the newest, which is measured against it
            if self._mean_prompt is None:
                self._mean_prompt = self._prompts[-1].clone()
            else:
                self._mean_prompt.mul_(self._memory).add_(self._prompts[-1], alpha=1.0 - self._memory)
        else:
            self._first_lasting = lasting_LE
        self._prompts.append(rates)
        while len(self._prompts) > max(self._running, 1) + 1:  # a new prompt joins the running requests
            self._prompts.popleft()
        # the first prompt teaches nothing: its deviation from the lasting rate holds the template effect too
        learned = self.deviation() if self._mean_prompt is not None else torch.zeros(self._shape, dtype=torch.float64)
        self._open = [learned, lasting_LE, torch.zeros(self._shape, dtype=torch.float64), 0.0]

    def on_decode(self, counts_LE: torch.Tensor, num_tokens: int) -> None:
        self._running = max(1, num_tokens)
        self.decode_since_prefill += num_tokens
        if self._open is not None:
            self._open[2] += counts_LE
            self._open[3] += num_tokens

    def _close(self) -> None:
        if self._open is not None and self._open[3] > 0:
            deviation, lasting, counts, tokens = self._open
            self.fit.add(deviation, counts / tokens - lasting)
        self._open = None

    def weight(self, z_score: float, fixed: float | None = None) -> float:
        """The learned weight, or `fixed` when given (AdaptiveSettings holds it to [0, 1])."""
        return self.fit.slope(z_score) if fixed is None else fixed

    def forecast(self, lasting_LE: torch.Tensor, z_score: float, fixed: float | None = None) -> torch.Tensor:
        """Routed pairs per token [L, E] over the rest of the running requests' decode."""
        if not self._prompts:
            return lasting_LE
        w = self.weight(z_score, fixed)
        return (lasting_LE + w * self.deviation()).clamp(min=0.0)
