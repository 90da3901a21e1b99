"""logging and checkpoint: where a run's metrics and checkpoints go."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Literal

from bapo_megatron.algo.rollout_corr_metrics import ABS_DIFF, MISMATCH_METRICS
from bapo_megatron.errors import ConfigError, check

RENAMED_METRICS = {
    "rollout/logprob_mismatch": ABS_DIFF,
    "rollout/logprob_mismatch_same_version": ABS_DIFF + "_same_version",
}
"""Metrics earlier versions reported and the name of the same figure now (a config carried from an
older run that bounds one is told, not left bounding a metric no step reports)."""


@dataclass(frozen=True, kw_only=True)
class RunChecksConfig:
    """logging.checks: figures each step's metrics must meet, as Miles and slime assert inside their
    CI runs; a step that fails one stops the run (one `error:` line naming the check, the step, the
    metric, its value and the bound; status.json "failed"). A check whose metric a step does not
    report is not applied at that step."""

    enabled: bool = False
    """Apply the checks below (the project's own end-to-end tests turn them on)."""
    kl_zero_at_first_step: bool = True
    """The KL to the reference (loss/kl, reported when algo.kl_coef > 0) is 0 at step 1 of a new run:
    the reference is the policy then, and that step's one update measures it before it moves (a step
    1 of several updates averages later ones in: not checked). Within kl_tolerance."""
    kl_tolerance: float = 1e-6
    """How far from 0 step 1's KL may be (float rounding between two forwards of equal weights)."""
    max_logprob_mismatch: float | None = None
    """The largest train-rollout absolute log-prob difference (each of mismatch_metrics) a step may
    report; None: not checked. fp32 engine and trainer: ~1e-6; a bf16 engine: ~1e-2."""
    mismatch_metrics: tuple[str, ...] = (ABS_DIFF + "_same_version",)
    """The metrics max_logprob_mismatch bounds, of rollout_corr_metrics.MISMATCH_METRICS: by default
    the tokens the step's own version sampled (the train-inference mismatch proper);
    rollout_corr/train_rollout_logprob_abs_diff counts older ones too, which an asynchronous or
    partial rollout raises. Checked where max_logprob_mismatch is set (RENAMED_METRICS' names get
    their new one)."""
    logprob_range: bool = True
    """Log-probs lie in (-inf, 0]: each of log_ppl_metrics (a mean of -log p over a step's
    sequences: no metric reports single log-probs) is finite and >= 0 (within kl_tolerance)."""
    log_ppl_metrics: tuple[str, ...] = ("rollout_corr/training_log_ppl", "rollout_corr/rollout_log_ppl")
    """The metrics logprob_range bounds: the trainer's and the engine's mean negative log-probs."""
    entropy_min: float | None = 0.0
    """policy/entropy is at least this (None: no lower bound; a collapsed policy nears 0)."""
    entropy_max: float | None = None
    """policy/entropy is at most this (None: no upper bound; ln(vocabulary size) is the most it can be)."""
    no_nan: bool = True
    """No metric is NaN, except in a step with an update skipped for a non-finite loss or gradient
    (its grad_norm is NaN: optimizer.max_skipped_steps judges those). Held-out evaluation figures,
    which join a step's line later, are not checked."""

    def __post_init__(self) -> None:
        check(
            math.isfinite(self.kl_tolerance) and self.kl_tolerance >= 0,
            "kl_tolerance",
            self.kl_tolerance,
            "must be >= 0",
        )
        if self.max_logprob_mismatch is not None:
            ok = math.isfinite(self.max_logprob_mismatch) and self.max_logprob_mismatch >= 0
            check(ok, "max_logprob_mismatch", self.max_logprob_mismatch, "must be >= 0 (None: not checked)")
            check(bool(self.mismatch_metrics), "mismatch_metrics", self.mismatch_metrics, "names no metric to bound")
            _check_mismatch_metrics(self.mismatch_metrics)
        for name, names in (("mismatch_metrics", self.mismatch_metrics), ("log_ppl_metrics", self.log_ppl_metrics)):
            check(all("/" in n for n in names), name, names, f"metric names have a slash ({ABS_DIFF})")
        low, high = self.entropy_min, self.entropy_max
        check(low is None or high is None or low <= high, "entropy_max", high, f"is below entropy_min={low}")


def _check_mismatch_metrics(names: tuple[str, ...]) -> None:
    """ConfigError unless each name is one of MISMATCH_METRICS, the log-prob differences the loss
    reports (a name no step reports would never be checked); an earlier version's name is told its
    new one."""
    for name in names:
        if name in RENAMED_METRICS:
            raise ConfigError("mismatch_metrics", names, f"{name} is now called {RENAMED_METRICS[name]}")
        known = ", ".join(MISMATCH_METRICS)
        check(name in MISMATCH_METRICS, "mismatch_metrics", names, f"{name} is none of the bounded metrics: {known}")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where metrics go: one logger, several backends."""

    backends: tuple[Literal["console", "jsonl", "wandb", "tensorboard"], ...] = ("console", "jsonl")
    """Where each step's metrics go: "console" (a line on stdout), "jsonl" (a file), "wandb",
    "tensorboard" (event files: every metric a scalar at its step, the run's config as text; needs
    the `tensorboard` package: pip install -e '.[tensorboard]')."""
    jsonl_path: str | None = None
    """The jsonl backend's file (None: metrics.jsonl in the run directory)."""
    tensorboard_dir: str | None = None
    """The tensorboard backend's directory (None: tensorboard/ in the run directory)."""
    wandb_project: str | None = None
    """The wandb project (needed by the wandb backend)."""
    wandb_run_name: str | None = None
    """The wandb run's name (None: the run's name)."""
    interval: int = 1
    """Log the metrics of every this many steps."""
    progress: bool | None = None
    """Progress bars on stderr for each step's rollout (groups complete, tokens/s) and updates
    (micro-batches); None: only where stderr is a terminal."""
    samples: int = 16
    """Samples of each step written to rollouts.jsonl in the run directory (0: none): the first
    groups of the step's batch, whole, in its order (the last one cut at this count); per sample its
    prompt and response text (token ids where the model has no tokenizer), reward, answer, lengths,
    finish reason and the policy versions that generated it."""
    save_batches: bool = False
    """Write each step's rollout batch (what the trainer trains on: tokens, behaviour log-probs,
    versions, rewards, loss masks, routes) to batches/step_NNNNNNNN.safetensors in the run
    directory: `rollout.replay=<run_dir>/batches` then trains on them alone, without engines."""
    checks: RunChecksConfig = field(default_factory=RunChecksConfig)
    """In-run checks every step's metrics must pass, or the run stops (off by default)."""

    def __post_init__(self) -> None:
        check(self.interval >= 1, "interval", self.interval, "must be >= 1")
        check(self.samples >= 0, "samples", self.samples, "must be >= 0 (0: no rollouts.jsonl)")
        if "wandb" in self.backends:
            check(
                self.wandb_project is not None, "wandb_project", self.wandb_project, "the wandb backend needs a project"
            )
        if "tensorboard" in self.backends:  # said now, not after the model has loaded
            check(
                importlib.util.find_spec("tensorboard") is not None,
                "backends",
                self.backends,
                "the tensorboard backend needs the tensorboard package: pip install -e '.[tensorboard]'",
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Megatron dist checkpoints: where, how often, how many to keep, whether to resume."""

    dir: str | None = None
    """Where the run's checkpoints go (None: its own run directory's ckpt/, <run_dir>/ckpt)."""
    save: bool = True
    """False: nothing is saved, and nothing resumed."""
    interval: int = 0
    """Save every this many steps (0: only at the end)."""
    keep_last: int = 2
    """Step directories kept (the newest; older ones are removed after each save)."""
    resume: bool = True
    """Continue from dir's latest checkpoint when there is one (false: refuse to start over one)."""
    allow_foreign: bool = False
    """Resume a checkpoint that another run wrote: another name, or another algo, data, reward or
    model (each step directory records its run in run.json). False: such a resume stops and says
    what differs; a new run starts from another's weights with model.mcore_path instead."""
    save_on_signal: bool = True
    """SIGTERM or SIGUSR1 (Slurm's warning before the time limit): finish the step, save, exit 0."""

    def __post_init__(self) -> None:
        check(self.interval >= 0, "interval", self.interval, "must be >= 0")
        check(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")
