"""logging and checkpoint: where a run's metrics and checkpoints go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bapo_megatron.errors import check


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """Where metrics go: one logger, several backends."""

    backends: tuple[Literal["console", "jsonl", "wandb"], ...] = ("console", "jsonl")
    jsonl_path: str | None = None
    """The jsonl backend's file (None: metrics.jsonl in the run directory)."""
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    interval: int = 1
    progress: bool | None = None
    """Progress bars on stderr for each step's rollout (groups complete, tokens/s) and updates
    (micro-batches); None: only where stderr is a terminal."""

    def __post_init__(self) -> None:
        check(self.interval >= 1, "interval", self.interval, "must be >= 1")
        if "wandb" in self.backends:
            check(
                self.wandb_project is not None, "wandb_project", self.wandb_project, "the wandb backend needs a project"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Megatron dist checkpoints: where, how often, how many to keep, whether to resume."""

    dir: str | None = None
    interval: int = 0
    """Save every this many steps (0: only at the end, when dir is set)."""
    keep_last: int = 2
    resume: bool = True
    """Continue from dir's latest checkpoint when there is one."""
    save_on_signal: bool = True
    """SIGTERM or SIGUSR1 (Slurm's warning before the time limit): finish the step, save, exit 0."""

    def __post_init__(self) -> None:
        check(self.interval >= 0, "interval", self.interval, "must be >= 0")
        check(self.keep_last >= 1, "keep_last", self.keep_last, "must be >= 1")
