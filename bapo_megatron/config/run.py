"""logging and checkpoint: where a run's metrics and checkpoints go."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from bapo_megatron.errors import check


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
