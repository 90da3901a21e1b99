"""BAPO's bound search as the spec states it: one full pass over the tokens per search step, as the
authors' code does. The vectorised search (bapo.py) is checked against it in tests and benchmarks."""

from __future__ import annotations

import torch

from bapo_megatron.algo.bapo import (
    TOL,
    BAPOConfig,
    ClipBounds,
    Contribution,
    check_shapes,
    first_invalid,
    walk,
)
from bapo_megatron.errors import NonFiniteInputError


def contributions_at(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    c_low: float,
    c_high: float,
    contribution: Contribution,
    dual_clip: float | None,
) -> tuple[float, float]:
    """P and N at one pair of bounds, written as the spec states them (float64, one pass)."""
    r, a, m = (t.reshape(-1).to(torch.float64) for t in (ratio, advantages, mask))
    counted = m != 0
    pos = counted & (a > 0)
    neg = counted & (a < 0)
    r = torch.where(counted, r, 1.0)
    if contribution == "gradient":
        p = torch.where(pos & (r < c_high), m * r * a, 0.0).sum()
        neg_grad = neg & (r > c_low) if dual_clip is None else neg & (r > c_low) & (r < dual_clip)
        n = torch.where(neg_grad, m * r * -a, 0.0).sum()
    else:
        p = torch.where(pos, m * a * torch.clamp(r, max=c_high), 0.0).sum()
        neg_value = torch.clamp(r, min=c_low)
        if dual_clip is not None:
            neg_value = torch.clamp(neg_value, max=dual_clip)
        n = torch.where(neg, m * -a * neg_value, 0.0).sum()
    return p.item(), n.item()


def search_clip_bounds_reference(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: BAPOConfig,
) -> ClipBounds:
    """The spec's iterative search, literally: evaluate rho, step, repeat. For tests and benchmarks."""
    check_shapes(ratio, advantages, mask)
    counted = mask.reshape(-1) != 0
    finite = torch.isfinite(ratio.reshape(-1)) & (ratio.reshape(-1) >= 0) & torch.isfinite(advantages.reshape(-1))
    valid_mask = torch.isfinite(mask.reshape(-1).double()) & (mask.reshape(-1) >= 0)
    if bool((counted & ~(finite & valid_mask)).any()):
        raise NonFiniteInputError(
            f"BAPO bound search: counted tokens have invalid inputs{first_invalid(ratio, advantages, mask)}"
        )

    def rho(c_low: float, c_high: float) -> float:
        p, n = contributions_at(ratio, advantages, mask, c_low, c_high, config.contribution, config.search_dual_clip)
        return 1.0 if p + n <= 0 else p / (p + n)

    visited = walk(config, lambda c_low, c_high: rho(c_low, c_high) >= config.target_rho - TOL)
    c_low, c_high = visited[-1]
    return ClipBounds(
        c_low=c_low,
        c_high=c_high,
        rho=rho(c_low, c_high),
        rho_start=rho(*visited[0]),
        steps=len(visited) - 1,
    )
