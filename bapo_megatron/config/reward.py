"""reward: how responses are scored, by which processes, and when a reward that fails stops the run."""

from __future__ import annotations

from dataclasses import dataclass, field

from bapo_megatron.errors import check


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The reward: one function or a table of them by record field, DAPO's overlong penalty on top,
    scored in worker processes bounded in time and memory."""

    function: str = "math"
    """"math" (math-verify on the last \\boxed answer), "dapo" (the last "Answer:" line, +1 / -1),
    "gsm8k" (the number after the last "#### ", 1 / 0, as verl scores GSM8K; "gsm8k_flexible": the
    last number), "exact" (the text, stripped), "exact_ids", or a function of yours, "pkg.module:fn" or
    "path/to/file.py:fn", called the way its parameters say: fn(text, ids, record) -> float with
    data.answer_field's value as record["answer"]; or, named as verl's are, as verl calls its
    compute_score(data_source, solution_str, ground_truth, extra_info): the record's data_source, the
    response text, data.answer_field's value, the record's extra_info; a number or {"score": ...}
    back. Parameters that take neither call are an error before the first step. A call that fails
    scores 0 and is counted (rollout/reward_errors)."""
    by: str | None = None
    """Pick each record's reward by this field (a dotted path; verl's data_source): its value names
    the reward in `table`, and `function` goes unused. A value without an entry is an error
    before the first step."""
    table: dict[str, str] = field(default_factory=dict)
    """by's map, value -> reward ({math_dapo: dapo, aime: math, mine: "path/to/file.py:fn"});
    formerly reward.routes, a name still read."""
    overlong_buffer: int | None = None
    """DAPO's overlong penalty, over any reward: a response longer than rollout.sampling.max_new_tokens
    minus this many tokens loses up to overlong_penalty_factor, linearly to the budget's end (None: off)."""
    overlong_penalty_factor: float = 1.0
    """What the overlong penalty takes from a response that reaches the budget's end."""
    workers: int = 1
    """Processes scoring responses beside generation."""
    timeout_s: float = 20.0
    """A reward call that takes longer fails (scores 0, is counted) and its worker is replaced.
    math-verify bounds each of its three stages (the answer's parse, the response's, the
    comparison) with a 5 s alarm of its own: its worst case measured 6.3 s on a loaded 2-core machine."""
    memory_mb: int = 4096
    """Address space a reward worker may take beyond its start (the interpreter and the imported
    reward); a call past it fails with MemoryError and the worker is replaced. 0: no limit."""
    range: tuple[float, float] = (-1e6, 1e6)
    """A reward outside [low, high], or an infinity, is a failed call (as NaN is)."""
    max_failure_share: float = 0.5
    """A step whose batch has more than this share of failed reward calls is a failing step; the
    run stops (exit 1, status.json "failed") after failure_steps of them in a row, or at once when
    every call of a step failed: a run whose reward never works learns nothing."""
    failure_steps: int = 3
    """Failing steps in a row (see max_failure_share) that stop the run."""

    def __post_init__(self) -> None:
        check((self.by is not None) == bool(self.table), "table", self.table, "goes with by (both or neither)")
        if self.overlong_buffer is not None:
            check(self.overlong_buffer >= 1, "overlong_buffer", self.overlong_buffer, "must be >= 1")
        factor = self.overlong_penalty_factor
        check(factor >= 0, "overlong_penalty_factor", factor, "must be >= 0")
        check(self.workers >= 1, "workers", self.workers, "must be >= 1")
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
        check(self.memory_mb >= 0, "memory_mb", self.memory_mb, "must be >= 0 (0: no limit)")
        low, high = self.range
        check(low < high, "range", list(self.range), "needs low < high")
        share = self.max_failure_share
        check(0 <= share < 1, "max_failure_share", share, "must be in [0, 1) (every call failing always stops)")
        check(self.failure_steps >= 1, "failure_steps", self.failure_steps, "must be >= 1")
