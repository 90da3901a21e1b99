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
    # sums ride in the means' table (denominator 0, never divided); mins in the maxes', negated;
    # each output's values stacked once (a metric it lacks adds 0 / -inf), then reduced over outputs
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=device)
    low = torch.full((), float("-inf"), dtype=f64, device=device)
    tables, extremes = [], []
    for out in outputs:
        nums = [out.means[n][0] if n in out.means else zero for n in mean_names]
        nums += [out.sums.get(n, zero) for n in sum_names]
        dens = [out.means[n][1] if n in out.means else zero for n in mean_names] + [zero] * len(sum_names)
        tables.append(torch.stack([torch.stack([v.to(f64) for v in nums]), torch.stack([v.to(f64) for v in dens])], 1))
        ends = [out.maxes[n].to(f64) if n in out.maxes else low for n in max_names]
        ends += [-out.mins[n].to(f64) if n in out.mins else low for n in min_names]
        extremes.append(torch.stack(ends) if ends else low.new_empty(0))
    sums = torch.stack(tables).sum(0) if mean_names or sum_names else zero.new_zeros(0, 2)
    maxes = torch.stack(extremes).amax(0)
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        if max_names or min_names:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    means = torch.where(sums[:, 1] != 0, sums[:, 0] / sums[:, 1], 0.0)
    means[len(mean_names) :] = sums[len(mean_names) :, 0]
    maxes[len(max_names) :] = -maxes[len(max_names) :]
    values = torch.cat([means, maxes]).tolist()
    return dict(zip(mean_names + sum_names + max_names + min_names, values, strict=True))
