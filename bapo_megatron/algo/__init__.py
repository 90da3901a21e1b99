"""The algorithm core: pure torch, no Megatron or SGLang import."""

from bapo_megatron.algo.advantages import AdvantageConfig, group_advantages, token_advantages
from bapo_megatron.algo.bapo import (
    PRESETS,
    BAPOConfig,
    BoundSearch,
    ClipBounds,
    bapo_preset,
    search_clip_bounds,
    search_path,
)
from bapo_megatron.algo.bapo_reference import search_clip_bounds_reference
from bapo_megatron.algo.losses import POLICY_LOSSES, PolicyBatch, PolicyLossConfig, policy_loss
from bapo_megatron.algo.metrics import LossOutput, reduce_metrics

__all__ = [
    "POLICY_LOSSES",
    "PRESETS",
    "AdvantageConfig",
    "BAPOConfig",
    "BoundSearch",
    "ClipBounds",
    "LossOutput",
    "PolicyBatch",
    "PolicyLossConfig",
    "bapo_preset",
    "group_advantages",
    "policy_loss",
    "reduce_metrics",
    "search_clip_bounds",
    "search_clip_bounds_reference",
    "search_path",
    "token_advantages",
]
