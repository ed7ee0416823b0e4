"""How the engine's capacity is shared fairly among requests: a step's prefill budget among the prompts being
prefilled, and the running slots among requests.

The prefill budget (--chunked-prefill-size tokens a step). Given oldest first, the whole budget went to the oldest
prompt: behind an 8k-token prompt a new request's first token waited for all 16 of its 512-token chunks (0.1 s became
4.9 s). Shared max-min fairly, every prompt gets an equal share each step and what a short prompt does not need goes
to the others: a new short prompt is prefilled in the next step, a long one still advances by at least budget /
prompts per step, and the budget is used whole.

The running slots (--max-running-requests). Waiting sequences are admitted round-robin across requests, but only
as slots free: a batch of 80 prompts admitted while the server was quiet held all 32 slots, and a lone request's
first token waited for a whole generation of the batch (TTFT p99 6.9 s against 1.5 s). So a request holding more
than its fair share (the slots over the requests running or waiting) gives one sequence back for each request that
waits with none running: that sequence is preempted (it recomputes its K/V later, the prefix cache keeping most of
its prompt), the newcomer starts within a step, and the batch keeps its share.

Prompt scoring (echo + logprobs) computes the whole vocabulary's logits for every prompt row, then their
log-softmax and top-k: on a CPU that is what a step's cost grows with (1.3 ms a decode row, 1.8 ms a scored row for a
152k vocabulary, measured), so a 512-row chunk stalled every other sequence's next token for 0.8-1.4 s, and even 16
rows a step beside 31 decode rows made each step 1.7x as long as the decode rows alone. So the rows of logits a step
computes are a budget shared decode-first (as vLLM and SGLang share a step's token budget between decodes and prefill
chunks): the prompts being scored get what the decode rows leave of --max-running-requests rows, and at least
SCORED_ROWS_FLOOR a step between them, so a scored prompt always advances (4k tokens in 512 steps at the floor) and
goes fast when the server has little else to do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable

SCORED_ROWS_FLOOR = 8  # ~15 ms a step for a 152k vocabulary on a desktop CPU


def scored_rows_budget(decode_rows: int, max_running: int) -> int:
    """Prompt rows to score this step, over all the prompts being scored: what `decode_rows` leave of
    `max_running` rows of logits, at least SCORED_ROWS_FLOOR."""
    return max(SCORED_ROWS_FLOOR, max_running - decode_rows)


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


def request_over_share(running: Counter, waiting: Iterable[Hashable], max_running: int) -> Hashable | None:
    """The request that should give a running slot back: when some request waits with none running, the one
    holding the most slots if that is more than the fair share (`max_running` over the requests running or
    waiting); else None. `running` counts each request's running sequences, `waiting` lists the waiting ones'."""
    waiting = set(waiting)
    if not any(running[r] == 0 for r in waiting):
        return None
    requests = {r for r, n in running.items() if n > 0} | waiting
    biggest = max(running, key=running.get, default=None)
    if biggest is None or running[biggest] <= max(1, max_running // len(requests)):
        return None
    return biggest
