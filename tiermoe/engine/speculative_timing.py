"""A verify step's cost as this machine measures it: step seconds fitted on what the step fed.

The bytes model (tiermoe.engine.speculative_length.StepCost) says what a step reads; what it takes also holds what
bytes do not: the host's work per step and per sequence, a verify segment's own attention call (decode rows attend
the pool in place together; a segment is gathered and attends alone), the sampling of every verified row. On a
small model or a busy host those dominate. So the engine times its decode steps (no prompt chunk in them) and fits
    seconds = c0 + c1 x sequences + c2 x verifying + c3 x drafted
by least squares over the recent steps (sums decayed per step, so the fit follows the load; outliers clipped),
lightly pulled toward zero where the steps seen do not tell the terms apart (one sequence alone: c0 and c1 are one
term). Until it has
seen enough steps with drafts (MIN_STEPS) of enough different shapes (MIN_SHAPES: in a busy batch nearly every
step has some draft, so steps without any cannot be waited for), and for steps with prompt chunks, the bytes model
decides (its units are one-token steps: every choice compares costs of one step, in one unit). When drafting stops
paying, only plain steps are timed: the drafted terms' evidence decays and the pull toward zero makes drafts look
cheap again, so they are tried again, measured, and dropped while they still do not pay.
"""

from __future__ import annotations

from tiermoe.engine.speculative_length import StepCost, StepShape

MIN_STEPS = 8  # steps with drafts before the fit decides
MIN_SHAPES = 3  # distinct (verifying, drafted) pairs among the timed steps: what tells the terms apart
# A step timed at more than this many times what the fit predicts (or, before the fit, than the plain steps' mean)
# is counted at that bound: a collection, a page fault or another process's burst would otherwise drag the
# least-squares fit for the next ~50 steps (on a busy 2-core host one 20 ms hiccup in 1.5 ms steps made a draft
# look dearer than a whole step).
OUTLIER = 3.0
DECAY = 0.98  # per timed step: the last ~50 steps count
RIDGE = 1e-3  # relative pull toward zero of each term (numerical: the collinear case)
TERMS = 4


class MeasuredStepCost:
    """StepCost's interface (`seconds(shape)`, `reuse`) from timed steps, the bytes model until they suffice.
    Plain Python floats: it runs every step, where a small tensor op costs more than the arithmetic."""

    def __init__(self, model: StepCost):
        self.model = model
        self.reuse = model.reuse
        self._xtx = [[0.0] * TERMS for _ in range(TERMS)]
        self._xty = [0.0] * TERMS
        self._drafted_steps = 0  # timed steps with drafts
        self._shapes: set[tuple[int, int]] = set()  # distinct (verifying, drafted) seen, up to MIN_SHAPES
        self._coef: list[float] | None = None
        self._plain_mean: float | None = None  # decayed mean of the plain steps' seconds

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A decode step's wall seconds (steps with prompt chunks are not fitted: their cost is the chunk's)."""
        if shape.other or shape.sequences == 0 or not seconds > 0:
            return
        bound = self.seconds(shape) if self.measured else self._plain_mean
        if bound is not None:
            seconds = min(seconds, OUTLIER * bound * (1 if self.measured else 1 + shape.drafted))
        if not shape.drafted:
            self._plain_mean = seconds if self._plain_mean is None else DECAY * self._plain_mean + (1 - DECAY) * seconds
        x = (1.0, float(shape.sequences), float(shape.verifying), float(shape.drafted))
        for i in range(TERMS):
            row = self._xtx[i]
            for j in range(TERMS):
                row[j] = DECAY * row[j] + x[i] * x[j]
            self._xty[i] = DECAY * self._xty[i] + x[i] * seconds
        self._drafted_steps += shape.drafted > 0
        if len(self._shapes) < MIN_SHAPES:
            self._shapes.add((shape.verifying, shape.drafted))
        self._coef = None

    @property
    def measured(self) -> bool:
        return self._drafted_steps >= MIN_STEPS and len(self._shapes) >= MIN_SHAPES

    def coefficients(self) -> list[float] | None:
        """[c0, c1, c2, c3] in seconds, or None before enough steps; each at least 0 (a draft never saves time)."""
        if not self.measured:
            return None
        if self._coef is None:
            ridge = RIDGE * sum(self._xtx[i][i] for i in range(TERMS)) / TERMS
            a = [[v + (ridge if i == j else 0.0) for j, v in enumerate(row)] for i, row in enumerate(self._xtx)]
            self._coef = [max(0.0, c) for c in _solve(a, list(self._xty))]
        return self._coef

    def seconds(self, shape: StepShape) -> float:
        return self.seconds_of(shape.sequences, shape.verifying, shape.drafted, shape.independent, shape.other)

    def seconds_of(self, sequences: int, verifying: int, drafted: int, independent: float, other: int) -> float:
        coef = self._coef if self._coef is not None else self.coefficients()
        if coef is None or other:
            return self.model.seconds_of(sequences, verifying, drafted, independent, other)
        return max(1e-9, coef[0] + coef[1] * sequences + coef[2] * verifying + coef[3] * drafted)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a x = b (a symmetric positive definite, small): Gaussian elimination with partial pivoting."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        if a[col][col] == 0.0:
            continue
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for c in range(col, n):
                a[r][c] -= f * a[col][c]
            b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = 0.0 if a[r][r] == 0.0 else (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return x
