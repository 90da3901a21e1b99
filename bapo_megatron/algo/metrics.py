"""What a loss returns, and how its metrics reduce over micro-batches and ranks."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class LossOutput:
    """A loss over some tokens: the sum to divide by the step's token count, and its metrics.

    `means` hold (numerator, denominator) pairs that add up over micro-batches and ranks and
    are divided once at the end; `sums` add up; `maxes` and `mins` reduce by maximum and minimum.
    """

    loss_sum: torch.Tensor
    token_count: torch.Tensor
    means: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    mins: dict[str, torch.Tensor] = field(default_factory=dict)

    def add_mean(self, name: str, numerator: torch.Tensor, denominator: torch.Tensor) -> None:
        self.means[name] = (numerator.detach(), denominator.detach())

    def add_max(self, name: str, value: torch.Tensor) -> None:
        self.maxes[name] = value.detach()

    def add_sum(self, name: str, value: torch.Tensor) -> None:
        self.sums[name] = value.detach()

    def add_min(self, name: str, value: torch.Tensor) -> None:
        self.mins[name] = value.detach()


def reduce_metrics(outputs: Iterable[LossOutput], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Combine the metrics of every micro-batch (and, with `group`, every rank) into floats.

    Two collectives at most (one SUM, one MAX), one host synchronisation. Every rank must
    pass outputs with the same metric names. A mean whose denominator is 0 reports 0.
    """
    outputs = list(outputs)
    if not outputs:
        return {}
    mean_names = sorted({name for out in outputs for name in out.means})
    sum_names = sorted({name for out in outputs for name in out.sums})
    max_names = sorted({name for out in outputs for name in out.maxes})
    min_names = sorted({name for out in outputs for name in out.mins})
    device = outputs[0].loss_sum.device
    # sums ride in the means' table (denominator 0, never divided); mins in the maxes', negated
    sums = torch.zeros(len(mean_names) + len(sum_names), 2, dtype=torch.float64, device=device)
    maxes = torch.full((len(max_names) + len(min_names),), float("-inf"), dtype=torch.float64, device=device)
    for out in outputs:
        for i, name in enumerate(mean_names):
            if name in out.means:
                num, den = out.means[name]
                sums[i, 0] += num.to(sums)
                sums[i, 1] += den.to(sums)
        for i, name in enumerate(sum_names, start=len(mean_names)):
            if name in out.sums:
                sums[i, 0] += out.sums[name].to(sums)
        for i, name in enumerate(max_names):
            if name in out.maxes:
                maxes[i] = torch.maximum(maxes[i], out.maxes[name].to(maxes))
        for i, name in enumerate(min_names, start=len(max_names)):
            if name in out.mins:
                maxes[i] = torch.maximum(maxes[i], -out.mins[name].to(maxes))
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        if max_names or min_names:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    means = torch.where(sums[:, 1] != 0, sums[:, 0] / sums[:, 1], 0.0)
    means[len(mean_names) :] = sums[len(mean_names) :, 0]
    maxes[len(max_names) :] = -maxes[len(max_names) :]
    values = torch.cat([means, maxes]).tolist()
    return dict(zip(mean_names + sum_names + max_names + min_names, values, strict=True))
