"""The cost fit: per batch-size bucket, step ms against rows verified, drafting ms and the draftless steps' ms."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_tree_spec.online_policy.constants import MIN_NONE_STEPS, MIN_PAIRS, MIN_STEPS, OUTLIER, SLOPE_PRIOR


@dataclass
class BucketCosts:
    """One batch-size bucket: step ms (draft excluded) against rows verified, as decayed sums.

    The slope (ms per row) comes from consecutive steps whose rows differ (first differences:
    sum dx * dy / (sum dx^2 + SLOPE_PRIOR)), so a slow drift of the whole step cost (longer contexts, other
    load on the machine) does not leak into it; the level is the decayed mean step at the mean rows. The
    prior matters while the rows have barely varied (a bucket's first steps, all drafting the same trees):
    there a noisy slope, extrapolated to the rows of a much smaller plan, predicted `none` at 36 ms per step
    where it took 55; with the prior an unproven slope leans to "rows are cheap", the side of speculating,
    until steps of different rows show otherwise.
    """

    w: float = 0.0
    sx: float = 0.0  # rows
    sy: float = 0.0  # ms
    sdxx: float = 0.0  # consecutive steps: sum of d(rows)^2
    sdxy: float = 0.0  # and of d(rows) * d(ms)
    pairs: float = 0.0  # consecutive pairs in those sums
    sb: float = 0.0  # batch sizes (the bucket's representative batch is their mean)
    draft_ms: list = field(default_factory=lambda: [0.0, 0.0])  # summed draft ms of [empty, drafting] steps
    draft_n: list = field(default_factory=lambda: [0.0, 0.0])
    none_w: float = 0.0  # steps that verified no draft node (the root rows only): what `none` costs, measured
    none_ms: float = 0.0
    last: tuple | None = None  # (step index, rows, ms) of the last sample

    def observe(self, step: int, batch: int, rows: int, step_ms: float, draft_ms: float, drafted: bool,
                draftless: bool = False, probe: bool = False) -> None:
        """draftless: the step verified no draft node. probe: a draftless step the policy inserted into a
        speculating plan to measure `none` (kept off the line: see `none_step`)."""
        if self.w >= MIN_STEPS:
            fit = self.line(None)
            if fit is not None and step_ms > OUTLIER * max(fit[0] + fit[1] * rows, 1e-3):
                self.last = None
                return
        if draftless or probe:
            self.none_w += 1
            self.none_ms += step_ms
        if probe:
            self.last = None
            return
        if self.last is not None and self.last[0] == step - 1 and self.last[1] != rows:
            dx, dy = rows - self.last[1], step_ms - self.last[2]
            self.sdxx += dx * dx
            self.sdxy += dx * dy
            self.pairs += 1
        self.last = (step, rows, step_ms)
        self.w += 1
        self.sx += rows
        self.sy += step_ms
        self.sb += batch
        self.draft_ms[drafted] += draft_ms
        self.draft_n[drafted] += 1

    def decay(self, factor: float, slope_factor: float, force: bool = False) -> None:
        """Old samples weigh `factor` (the slope's `slope_factor`, unless that leaves under MIN_PAIRS pairs and
        not `force`: exploration makes pairs sparse)."""
        for name in ("w", "sx", "sy", "sb"):
            setattr(self, name, getattr(self, name) * factor)
        if force or self.pairs * slope_factor >= MIN_PAIRS:
            self.sdxx *= slope_factor
            self.sdxy *= slope_factor
            self.pairs *= slope_factor
        self.draft_ms = [v * factor for v in self.draft_ms]
        self.draft_n = [v * factor for v in self.draft_n]
        self.none_w *= factor
        self.none_ms *= factor

    def line(self, pooled_slope: float | None) -> tuple[float, float] | None:
        """(intercept ms, ms per row), or None while rows never varied and no pooled slope is known."""
        if self.w <= 0:
            return None
        if self.sdxx > 0:
            slope = self.sdxy / (self.sdxx + SLOPE_PRIOR)
        elif pooled_slope is not None:
            slope = pooled_slope
        else:
            return None
        slope = max(0.0, slope)  # more rows never make a step faster; noise can say otherwise
        return (self.sy - slope * self.sx) / self.w, slope

    def none_step(self) -> float | None:
        """Mean ms of the draftless steps measured here (None: too few). A step's cost is not linear in its
        rows down to the root rows alone: on CPU a 16-request step of SmolLM2 took 100 ms draftless and 241 ms
        at ~6 rows a request, where the slope between neighbouring speculating steps, extrapolated, priced the
        draftless step at over 160 ms, and the policy kept speculating where switching it off was 1.11x faster."""
        return self.none_ms / self.none_w if self.none_w >= MIN_NONE_STEPS else None

    def draft(self, drafted: bool) -> float:
        """Mean draft ms of steps that drafted (True) or not; 0 before any such step."""
        n = self.draft_n[drafted]
        return self.draft_ms[drafted] / n if n > 0 else 0.0

    @property
    def batch(self) -> float:
        return self.sb / self.w if self.w > 0 else 0.0
