"""logging.checks: each check stops a run on a crafted metrics sequence that breaks it, and lets a good
one pass; the checks run where every step's metrics pass (logger.StepLog.record)."""

import math
from dataclasses import replace

import pytest

from bapo_megatron.config import LoggingConfig, load_config
from bapo_megatron.config.run import RunChecksConfig
from bapo_megatron.errors import ConfigError, RunStopped
from bapo_megatron.logger import MetricLogger, StepLog
from bapo_megatron.run_checks import CheckFailed, RunChecks

ON = RunChecksConfig(enabled=True, max_logprob_mismatch=1e-5, entropy_max=math.log(250))


def good_steps() -> list[dict[str, float]]:
    """Three steps of a healthy fp32 run with a KL loss: what the e2e runs report."""
    return [
        {
            "loss/kl": 0.0 if step == 1 else 1e-3 * step,
            "train/step": float(step),
            "train/skipped": 0.0,
            "train/grad_norm": 0.5,
            "rollout_corr/train_rollout_logprob_abs_diff": 2e-3,  # older tokens (async): not bounded by default
            "rollout_corr/train_rollout_logprob_abs_diff_same_version": 8e-7,
            "rollout_corr/training_log_ppl": 5.1,
            "rollout_corr/rollout_log_ppl": 5.1,
            "policy/entropy": 5.3,
            "rollout/reward_mean": 0.5,
        }
        for step in (1, 2, 3)
    ]


def run(cfg: RunChecksConfig, steps: list[dict[str, float]]) -> None:
    checks = RunChecks(cfg)
    for step, metrics in enumerate(steps, start=1):
        checks.step(step, metrics)


def test_a_good_run_passes_every_check():
    run(ON, good_steps())


BROKEN = [
    # (check, step, metric, value, what the line says of the bound)
    ("no_nan", 2, "rollout/reward_mean", math.nan, "must be a number"),
    ("kl_zero_at_first_step", 1, "loss/kl", 3e-4, "must be 0 within 1e-06"),
    ("kl_zero_at_first_step", 1, "loss/kl", -2e-6, "must be 0 within 1e-06"),
    ("max_logprob_mismatch", 3, "rollout_corr/train_rollout_logprob_abs_diff_same_version", 0.02, "max 1e-05"),
    ("logprob_range", 2, "rollout_corr/training_log_ppl", -0.01, "must be finite and >= 0"),
    ("logprob_range", 2, "rollout_corr/rollout_log_ppl", math.inf, "must be finite and >= 0"),
    ("entropy_min", 3, "policy/entropy", -1e-3, "min 0"),
    ("entropy_max", 2, "policy/entropy", 6.0, "max 5.52146"),
]


@pytest.mark.parametrize(("check", "step", "metric", "value", "bound"), BROKEN)
def test_each_check_fires_with_one_line_naming_the_check_step_metric_value_and_bound(check, step, metric, value, bound):
    steps = good_steps()
    steps[step - 1][metric] = value
    with pytest.raises(CheckFailed) as failed:
        run(ON, steps)
    err = failed.value
    assert isinstance(err, RunStopped)  # the driver's path: one `error:` line, exit 1, status.json "failed"
    assert (err.check, err.step, err.metric) == (check, step, metric)
    line = str(err)
    assert "\n" not in line
    assert line.startswith(f"check {check} failed at step {step}: {metric}={value:.6g}, {bound}"), line


def test_checks_are_off_by_default_and_each_can_be_turned_off():
    steps = good_steps()
    steps[0].update({"loss/kl": 1.0, "rollout/reward_mean": math.nan, "policy/entropy": -1.0})
    steps[0]["rollout_corr/train_rollout_logprob_abs_diff_same_version"] = 1.0
    steps[0]["rollout_corr/training_log_ppl"] = -1.0
    run(RunChecksConfig(), steps)
    off = replace(ON, kl_zero_at_first_step=False, no_nan=False, max_logprob_mismatch=None, logprob_range=False)
    run(replace(off, entropy_min=None), steps)


def test_the_mismatch_bound_gates_the_metrics_it_is_given():
    """rollout_corr/train_rollout_logprob_abs_diff (older tokens too) and its splits are gated when named."""
    steps = good_steps()
    run(ON, steps)  # the async run's 2e-3 on every token is not the same-version figure
    with pytest.raises(CheckFailed, match="rollout_corr/train_rollout_logprob_abs_diff=0.002, max 1e-05"):
        run(replace(ON, mismatch_metrics=("rollout_corr/train_rollout_logprob_abs_diff",)), steps)
    steps[1]["rollout_corr/train_rollout_logprob_abs_diff_older"] = 0.3
    with pytest.raises(CheckFailed, match="at step 2: rollout_corr/train_rollout_logprob_abs_diff_older=0.3"):
        run(replace(ON, mismatch_metrics=("rollout_corr/train_rollout_logprob_abs_diff_older",)), steps)


def test_the_kl_is_held_to_zero_only_where_the_reference_is_the_policy_measured():
    """Step 1 of one update (train/step 1) only: a resumed run's first step, a later step, a step 1 of
    two updates (the second measures moved weights) and a run without a KL loss are not held to 0."""
    steps = good_steps()
    for s in steps:
        s["loss/kl"] = 0.01
    with pytest.raises(CheckFailed, match="kl_zero_at_first_step failed at step 1"):
        run(ON, steps)
    RunChecks(ON).step(5, steps[0])  # a resumed run's first step
    run(ON, [{**steps[0], "train/step": 2.0}])  # step 1 of two updates
    run(ON, [{k: v for k, v in s.items() if k != "loss/kl"} for s in good_steps()])  # no kl_coef


def test_a_step_with_a_skipped_update_may_report_nan():
    """Its grad_norm is NaN (nothing was applied); optimizer.max_skipped_steps judges such steps."""
    steps = good_steps()
    steps[1].update({"train/grad_norm": math.nan, "train/skipped": 1.0})
    run(ON, steps)


def test_absent_metrics_pass_and_step_zero_is_not_checked():
    run(ON, [{"train/step": 1.0}, {}])
    RunChecks(ON).step(0, {"eval/greedy_acc": math.nan})  # the starting policy's evaluation line


def test_the_step_log_checks_each_recorded_step_after_writing_its_line(tmp_path):
    """StepLog.record (every backend's path) raises at the bad step; metrics.jsonl has the step's line."""
    cfg = LoggingConfig(backends=("jsonl",), checks=ON)
    log = StepLog(MetricLogger(cfg, job_name="t", config={}, run_dir=tmp_path))
    steps = good_steps()
    steps[1]["policy/entropy"] = math.nan
    log.record(1, steps[0])
    with pytest.raises(CheckFailed, match="check no_nan failed at step 2: policy/entropy=nan"):
        log.record(2, steps[1])
    log.logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and '"policy/entropy": null' in lines[1]


def test_a_rank_that_does_not_log_checks_too(tmp_path):
    """Every rank holds the trainer's figures and stops at the same step (none waits on a collective)."""
    cfg = LoggingConfig(backends=("jsonl",), checks=ON)
    log = StepLog(MetricLogger(cfg, job_name="t", config={}, enabled=False, run_dir=tmp_path))
    with pytest.raises(CheckFailed, match="check kl_zero_at_first_step failed at step 1: loss/kl=0.5"):
        log.record(1, {**good_steps()[0], "loss/kl": 0.5})
    assert not (tmp_path / "metrics.jsonl").exists()


def test_the_checks_are_set_from_the_command_line_and_bad_bounds_are_refused():
    cfg = load_config(
        None,
        [
            "logging.checks.enabled=true",
            "logging.checks.max_logprob_mismatch=1e-5",
            "logging.checks.mismatch_metrics=[rollout_corr/log_ppl_abs_diff,rollout_corr/train_rollout_logprob_abs_diff]",
            "logging.checks.entropy_max=6",
        ],
    ).logging.checks
    assert cfg.enabled and cfg.max_logprob_mismatch == 1e-5 and cfg.entropy_max == 6.0
    assert cfg.mismatch_metrics == ("rollout_corr/log_ppl_abs_diff", "rollout_corr/train_rollout_logprob_abs_diff")
    for bad, field in (
        ({"max_logprob_mismatch": -1.0}, "max_logprob_mismatch"),
        ({"kl_tolerance": math.nan}, "kl_tolerance"),
        ({"entropy_min": 2.0, "entropy_max": 1.0}, "entropy_max"),
        ({"mismatch_metrics": ("logprob_mismatch",)}, "mismatch_metrics"),
    ):
        with pytest.raises(ConfigError, match=field):
            RunChecksConfig(**bad)
