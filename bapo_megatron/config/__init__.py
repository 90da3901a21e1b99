"""Typed configuration of a whole job, a keyword-only dataclass per section, read by `load_config`."""

from bapo_megatron.config.data import DataConfig
from bapo_megatron.config.engines import SGLANG_DEPRECATED_ARGS, SGLANG_LAUNCHER_ARGS, EnginesConfig
from bapo_megatron.config.evaluation import EVAL_SET_NAME, EvalConfig, EvalSetConfig
from bapo_megatron.config.job import JobConfig, parse_stop_when
from bapo_megatron.config.loader import (
    MOVED,
    SECTION_PRESETS,
    build,
    dotted,
    dump_config,
    load_config,
    parse_override,
    to_dict,
)
from bapo_megatron.config.reward import RewardConfig
from bapo_megatron.config.rollout import PartialConfig, RolloutConfig, SamplingConfig, WeightSyncConfig
from bapo_megatron.config.run import CheckpointConfig, LoggingConfig
from bapo_megatron.config.trainer import AlgoConfig, ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig

__all__ = [
    "EVAL_SET_NAME",
    "MOVED",
    "SECTION_PRESETS",
    "SGLANG_DEPRECATED_ARGS",
    "SGLANG_LAUNCHER_ARGS",
    "AlgoConfig",
    "CheckpointConfig",
    "DataConfig",
    "EnginesConfig",
    "EvalConfig",
    "EvalSetConfig",
    "JobConfig",
    "LoggingConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PartialConfig",
    "RewardConfig",
    "RolloutConfig",
    "SamplingConfig",
    "WeightSyncConfig",
    "build",
    "dotted",
    "dump_config",
    "load_config",
    "parse_override",
    "parse_stop_when",
    "to_dict",
]
