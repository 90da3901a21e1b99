"""Group-relative advantages: GRPO, Dr.GRPO (no std normalisation) and RLOO."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from bapo_megatron.errors import check

Estimator = Literal["grpo", "dr_grpo", "rloo"]


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards of the n samples of one prompt become advantages."""

    estimator: Estimator = "grpo"
    """"grpo": (R - mean) / (std + eps); "dr_grpo": R - mean (GRPO without std normalisation,
    Liu et al.; the loss's global token mean already removes the length bias);
    "rloo": R - mean of the other samples."""
    std_eps: float = 1e-6
    """grpo: added to the group's standard deviation."""

    def __post_init__(self) -> None:
        check(
            self.estimator in ("grpo", "dr_grpo", "rloo"),
            "estimator",
            self.estimator,
            "must be 'grpo', 'dr_grpo' or 'rloo'",
        )
        check(math.isfinite(self.std_eps) and self.std_eps > 0, "std_eps", self.std_eps, "must be > 0")


def group_advantages(rewards: torch.Tensor, config: AdvantageConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages of rewards [num_groups, group_size], and metrics.

    A group whose rewards are all identical carries no signal: its advantages are exactly 0,
    and it is counted in advantage/zero_groups.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, group_size]; got shape {tuple(rewards.shape)}")
    groups, n = rewards.shape
    check(n >= 2, "group_size", n, "group-relative advantages need at least 2 samples per prompt")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(f"rewards must be finite; got {rewards[~torch.isfinite(rewards)][:4].tolist()}")
    r = rewards.to(torch.float64)
    mean = r.mean(dim=1, keepdim=True)
    if config.estimator == "grpo":
        adv = (r - mean) / (r.std(dim=1, keepdim=True) + config.std_eps)
    elif config.estimator == "dr_grpo":
        adv = r - mean
    else:
        adv = (r - mean) * (n / (n - 1))  # R_i - mean of the other n - 1 samples
    flat = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    adv = torch.where(flat, 0.0, adv)
    zero_groups = int(flat.sum())
    metrics = {
        "advantage/zero_groups": float(zero_groups),
        "advantage/zero_group_frac": zero_groups / groups if groups else 0.0,
        "advantage/mean_abs": adv.abs().mean().item() if adv.numel() else 0.0,
        "advantage/reward_mean": r.mean().item() if r.numel() else 0.0,
    }
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32), metrics


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast per-response advantages [batch] over a [batch, seq] token mask (0 where masked)."""
    if advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"need advantages [batch] and mask [batch, seq]; got {tuple(advantages.shape)} and {tuple(mask.shape)}"
        )
    return torch.where(mask != 0, advantages.unsqueeze(1), 0.0).to(advantages.dtype)
