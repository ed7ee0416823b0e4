"""How the sampler draws (issue: serving under hostile load): an unseeded request by an inverse transform, one
random number a token, from the same distribution; a seeded one with torch.multinomial, so its tokens stay what
they were. torch.multinomial draws one exponential number per vocabulary entry for a single sample (3-7 ms a row of
a 152k vocabulary), which made every step beside a few sampled sequences 1.5-2x as long for the greedy ones."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tiermoe.engine.sampling import SamplingParams, _kept_mass, sample
from tiermoe.errors import TiermoeError

RANDOM_OPS = ("rand", "exponential_", "uniform_", "normal_", "bernoulli_", "random_")


class RandomNumbers(TorchDispatchMode):
    """Counts the random numbers torch ops make: the elements of each random op's output, and for torch.multinomial
    (whose exponential numbers are drawn inside the op) one per category per sample."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in RANDOM_OPS:
            self.count += out.numel()
        elif name == "multinomial":
            self.count += args[0].shape[-1] * out.numel()
        return out


def test_an_unseeded_draw_takes_one_random_number_where_a_seeded_one_takes_one_per_token():
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    with RandomNumbers() as unseeded:
        sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(1))
    with RandomNumbers() as seeded:
        sample(logits, SamplingParams(temperature=1.0, seed=3), torch.Generator().manual_seed(1))
    # on the parent both drew 5000 (torch.multinomial's exponential numbers)
    assert unseeded.count == 1 and seeded.count == 5000


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3),
                                    SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(min_p=0.2)])
def test_unseeded_draws_follow_the_kept_distribution(params):
    logits = torch.tensor([2.0, 1.5, 0.0, -1.0, 1.0, -30.0])
    expected = _kept_mass(logits, params)
    expected = expected / expected.sum()
    gen, draws = torch.Generator().manual_seed(0), 20_000
    counts = torch.bincount(torch.tensor([sample(logits, params, gen) for _ in range(draws)]), minlength=6)
    # within 5 standard deviations of the expected count, and never a token the filters dropped
    sigma = (draws * expected * (1 - expected)).sqrt()
    assert ((counts - draws * expected).abs() <= 5 * sigma + 1).all(), (counts, draws * expected)
    assert (counts[expected == 0] == 0).all()


def test_a_seeded_draw_is_torch_multinomial_on_its_generator():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    for k in range(20):
        gen, twin = torch.Generator().manual_seed(k), torch.Generator().manual_seed(k)
        assert sample(logits, params, gen) == int(torch.multinomial(_kept_mass(logits, params), 1, generator=twin))


def test_an_unseeded_draw_from_no_mass_is_refused():
    with pytest.raises(TiermoeError, match="cannot sample"):
        sample(torch.full((4,), float("nan")), SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))


class SortedSizes(TorchDispatchMode):
    """The number of elements each torch sort is given."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "sort":
            self.sizes.append(args[0].numel())
        return func(*args, **(kwargs or {}))


def full_sort_kept_mass(logits_V, params):
    """top_k, then top_p over the whole sorted vocabulary: what the sampler computed before it sorted the support."""
    logits_V = logits_V / params.temperature
    if params.top_k:
        logits_V = logits_V.masked_fill(logits_V < torch.topk(logits_V, params.top_k).values[-1], float("-inf"))
    probs_V = torch.softmax(logits_V, dim=-1)
    sorted_p, order = torch.sort(probs_V, descending=True)
    drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= params.top_p
    drop[0] = False
    sorted_p[drop] = 0
    return torch.zeros_like(probs_V).scatter_(0, order, sorted_p)


@pytest.mark.parametrize("top_k", [1, 20, 64])
@pytest.mark.parametrize("top_p", [1e-9, 0.8, 0.999])
def test_top_p_after_top_k_sorts_only_the_top_k_and_keeps_the_same_tokens(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k)
    params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p)
    for _ in range(5):
        logits = 3 * torch.randn(20_000, generator=gen)
        with SortedSizes() as sorts:
            kept = _kept_mass(logits, params)
        assert sorts.sizes and max(sorts.sizes) <= top_k  # no sort of the vocabulary
        assert torch.equal(kept, full_sort_kept_mass(logits, params))


def test_top_p_after_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([5.0, 3.0, 3.0, 3.0, 1.0, 0.0])
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.9999)
    kept = _kept_mass(logits, params)
    assert torch.equal(kept > 0, torch.tensor([True, True, True, True, False, False]))
    assert torch.equal(kept, full_sort_kept_mass(logits, params))
