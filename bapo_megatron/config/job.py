"""The whole job: every section, and the checks that span sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from bapo_megatron.config.data import DataConfig
from bapo_megatron.config.evaluation import EvalConfig
from bapo_megatron.config.reward import RewardConfig
from bapo_megatron.config.rollout import RolloutConfig
from bapo_megatron.config.run import CheckpointConfig, LoggingConfig
from bapo_megatron.config.trainer import AlgoConfig, ModelConfig, OptimizerConfig, ParallelConfig
from bapo_megatron.errors import ConfigError, check


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """A whole BAPO job."""

    name: str = "bapo"
    """The run's name: its directory (runs/<name>) and the name its checkpoints record."""
    steps: int = 20
    """Rollout-and-train iterations."""
    seed: int = 1234
    """Seeds the model's initialisation, dropout and the engines' sampling (the prompt order has
    data.seed)."""
    run_dir: str | None = None
    """Where the run writes metrics.jsonl, config.yaml, engine logs and, unless checkpoint.dir says
    otherwise, its checkpoints (None: runs/<name>)."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    stop_when: str | None = None
    """End the run early, as finished (checkpoint saved), once the mean of a metric over its last
    stop_window steps crosses a value: "METRIC>=VALUE" or "METRIC<=VALUE", e.g.
    "sft/answer_acc>=0.2" (the warm start answers 20% of its batches greedily) or "loss/sft<=0.5"."""
    stop_window: int = 10
    """Steps whose values of stop_when's metric are averaged."""

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        check(self.stop_window >= 1, "stop_window", self.stop_window, "must be >= 1")
        if self.stop_when is not None:
            parse_stop_when(self.stop_when)
        check(
            self.rollout.samples_per_prompt >= 2,
            "rollout.samples_per_prompt",
            self.rollout.samples_per_prompt,
            "group-relative advantages need at least 2 samples per prompt",
        )
        check(
            self.rollout.prompts_per_step % self.algo.updates_per_batch == 0,
            "algo.updates_per_batch",
            self.algo.updates_per_batch,
            f"must divide rollout.prompts_per_step={self.rollout.prompts_per_step} (mini-batches hold whole groups)",
        )
        if self.reward.overlong_buffer is not None:
            new = self.rollout.sampling.max_new_tokens
            check(
                self.reward.overlong_buffer <= new,
                "reward.overlong_buffer",
                self.reward.overlong_buffer,
                f"must not exceed rollout.sampling.max_new_tokens={new} (the penalty's buffer ends the budget)",
            )

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir) if self.run_dir else Path("runs") / self.name

    @property
    def checkpoint_path(self) -> Path | None:
        """Where the run's checkpoints go: checkpoint.dir, else its own <run_dir>/ckpt (a run never
        shares another's by default); None with checkpoint.save false."""
        if not self.checkpoint.save:
            return None
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_path / "ckpt"


def parse_stop_when(rule: str) -> tuple[str, str, float]:
    """The rule METRIC>=VALUE or METRIC<=VALUE as (metric, ">=" or "<=", value); ConfigError otherwise."""
    for op in (">=", "<="):
        metric, found, value = rule.partition(op)
        if found:
            metric = metric.strip()
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if metric and math.isfinite(number):
                return metric, op, number
    raise ConfigError("stop_when", rule, 'must be "METRIC>=VALUE" or "METRIC<=VALUE", e.g. "sft/answer_acc>=0.2"')
