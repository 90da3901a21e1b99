"""In-run checks (logging.checks): figures every step's metrics must meet, or the run stops.

    checks = RunChecks(cfg.logging.checks)
    checks.step(step, metrics)   # CheckFailed (a RunStopped) naming the check, step, metric, value and bound

Miles and slime assert these inside their CI runs, NeMo-RL gates its nightly runs on the like: a run
that drifted (engines that hold other weights, a reference that is not the starting policy, a
log-prob or entropy out of what a distribution allows, a NaN) stops at the step it showed, before
it trains on or saves what followed. The checks read only metrics the step reports; each passes
when its metric is absent (a KL without algo.kl_coef, a same-version mismatch with no token of the
step's version).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from bapo_megatron.config.run import RunChecksConfig
from bapo_megatron.errors import RunStopped

KL = "loss/kl"
ENTROPY = "policy/entropy"


class CheckFailed(RunStopped):
    """A step's metric outside what logging.checks allows: one line naming the check, the step, the
    metric, its value and the bound."""

    def __init__(self, check: str, step: int, metric: str, value: float, bound: str) -> None:
        super().__init__(f"check {check} failed at step {step}: {metric}={value:.6g}, {bound} (logging.checks)")
        self.check, self.step, self.metric, self.value = check, step, metric, value


class RunChecks:
    """logging.checks applied to each step's metrics, as the trainer reports them (every rank holds
    the trainer's figures: each stops at the same step)."""

    def __init__(self, cfg: RunChecksConfig) -> None:
        self.cfg = cfg

    def step(self, step: int, metrics: dict[str, float]) -> None:
        """CheckFailed for the first check the step's metrics fail (none: checks off, or step 0: the
        starting policy's evaluation, before any training)."""
        if not self.cfg.enabled or step < 1:
            return
        for failure in self.failures(step, metrics):
            raise failure

    def failures(self, step: int, metrics: dict[str, float]) -> Iterator[CheckFailed]:
        cfg = self.cfg
        if cfg.no_nan and not metrics.get("train/skipped"):
            for name, value in metrics.items():
                if isinstance(value, float) and math.isnan(value):
                    yield CheckFailed("no_nan", step, name, value, "must be a number")
        # step 1 of one update, not skipped (train/step 1): the reference is the policy the loss measured
        first = cfg.kl_zero_at_first_step and step == 1 and metrics.get("train/step") == 1 and KL in metrics
        if first and not abs(metrics[KL]) <= cfg.kl_tolerance:
            bound = f"must be 0 within {cfg.kl_tolerance:g} (the reference is the policy before step 1's update)"
            yield CheckFailed("kl_zero_at_first_step", step, KL, metrics[KL], bound)
        if cfg.max_logprob_mismatch is not None:
            for name in cfg.mismatch_metrics:
                if name in metrics and not metrics[name] <= cfg.max_logprob_mismatch:
                    yield CheckFailed(
                        "max_logprob_mismatch", step, name, metrics[name], f"max {cfg.max_logprob_mismatch:g}"
                    )
        if cfg.logprob_range:
            for name in cfg.log_ppl_metrics:
                value = metrics.get(name)
                if value is not None and not (math.isfinite(value) and value >= -cfg.kl_tolerance):
                    yield CheckFailed("logprob_range", step, name, value, "must be finite and >= 0 (log-probs <= 0)")
        yield from self._entropy(step, metrics.get(ENTROPY))

    def _entropy(self, step: int, value: float | None) -> Iterator[CheckFailed]:
        low, high = self.cfg.entropy_min, self.cfg.entropy_max
        if value is None or math.isnan(value):  # (a NaN is no_nan's)
            return
        if low is not None and not value >= low:
            yield CheckFailed("entropy_min", step, ENTROPY, value, f"min {low:g}")
        if high is not None and not value <= high:
            yield CheckFailed("entropy_max", step, ENTROPY, value, f"max {high:g}")
