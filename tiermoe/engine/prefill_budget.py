"""How a step's prefill budget (--chunked-prefill-size tokens) is shared among the prompts being prefilled.

Given oldest first, the whole budget went to the oldest prompt: behind an 8k-token prompt a new request's first
token waited for all 16 of its 512-token chunks (0.1 s became 4.9 s). Shared max-min fairly, every prompt gets an
equal share each step and what a short prompt does not need goes to the others: a new short prompt is prefilled in
the next step, a long one still advances by at least budget / prompts per step, and the budget is used whole.
"""

from __future__ import annotations


def share_prefill_budget(needs: list[int], budget: int) -> list[int]:
    """Each prompt's tokens this step (in the order of `needs`, oldest first: the tokens each has left): the
    max-min fair shares of `budget`, the few tokens an even split leaves over going to the oldest."""
    shares = [0] * len(needs)
    left = budget
    waiting = sorted(range(len(needs)), key=lambda i: needs[i])  # the smallest needs are met whole first
    for rank, i in enumerate(waiting):
        shares[i] = min(needs[i], left // (len(needs) - rank))
        left -= shares[i]
    unmet = [i for i in range(len(needs)) if shares[i] < needs[i]]
    level = min((shares[i] for i in unmet), default=0)  # the even split's floor (the later ones took its remainder)
    for i in unmet:
        left += shares[i] - level
        shares[i] = level
    for i in unmet[:left]:  # the remainder of the even split (fewer tokens than unmet prompts): one each, oldest first
        shares[i] += 1
    return shares
