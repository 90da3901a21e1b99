"""Packed micro-batches: a step's samples laid end to end in rows, attention kept inside each sample.

A padded micro-batch (trainer/microbatch.py) is [samples, longest]: on long-tailed lengths little
is lost without a virtual pipeline, but the interleaved schedule needs every micro-batch of a step
in one shape, and padding them all to the step's largest wastes most of the compute. Packed, a
micro-batch is one row holding whole samples, at most parallel.max_tokens_per_microbatch tokens:
the fewest rows the budget allows, filled as evenly as that count allows. A row is as long as
its samples (rounded up to the layout's sequence multiple); under a virtual pipeline every row of
a rank takes the rank's longest, one shape for its schedule.

Each sample in a row starts its positions at 0 and attends to itself only:
  - Transformer Engine: THD, the row's segment boundaries as `cu_seqlens` (Megatron's
    PackedSeqParams); its fused RoPE restarts at each boundary;
  - the local implementation (CPU): a block-diagonal causal mask over the row. Megatron's RoPE
    then runs over the row's positions, which changes nothing inside a sample (RoPE depends on
    the difference of two positions); the attention costs the whole row squared.
The row's tail past its samples is a segment of its own (padding, attending to itself).
A model with a layer that would still mix the samples (a recurrent state running across the row,
a sliding window with a mask of its own: its family's packing_leak) trains one sample a row.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import torch

from bapo_megatron.common.batch import Sample
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.microbatch import (
    MicroBatch,
    check_fits,
    counted_tokens,
    fill_samples,
    new_rows,
    pad_microbatch,
    place_routes,
    plan_microbatches,
    uniform_shape,
)


def plan_packed(lengths: list[int], dp_size: int, capacity: int, multiple_of: int = 1) -> list[list[list[int]]]:
    """plan[dp_rank][microbatch] = sample indices, each micro-batch's samples within `capacity`
    tokens, every rank with the same number of micro-batches, a multiple of `multiple_of`.

    The fewest micro-batches the capacity allows, as even as that count allows: rows are filled
    best fit, longest first (each sample to the fullest row it fits in), at the smallest capacity
    that needs no more rows than the budget does (a binary search; a row of one shape a step is
    then no longer than it must be). Ranks get rows in turn by their tokens (the rank with the
    fewest takes the next largest); with too few rows the fullest is split in two."""
    check_fits(lengths, dp_size, capacity)

    def per_rank(rows: int) -> int:
        return math.ceil(math.ceil(rows / dp_size) / multiple_of) * multiple_of

    need = per_rank(len(_best_fit(lengths, capacity)))
    samples_per_rank = len(lengths) // dp_size
    if need > samples_per_rank:
        raise ValueError(
            f"{samples_per_rank} samples per data-parallel rank cannot make {need} micro-batches (the "
            f"interleaved pipeline schedule runs them in groups of {multiple_of}): use more samples a step"
        )
    low, high = max(lengths), capacity
    while low < high:
        mid = (low + high) // 2
        if per_rank(len(_best_fit(lengths, mid))) <= need:
            high = mid
        else:
            low = mid + 1
    return _deal(_best_fit(lengths, low), lengths, dp_size, need)


def _best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices within `capacity` tokens: longest first, each to the fullest row it fits."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row) sorted: the best fit is the first with enough
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k < len(room):
            left, row = room.pop(k)
            rows[row].append(i)
        else:
            left, row = capacity, len(rows)
            rows.append([i])
        bisect.insort(room, (left - lengths[i], row))
    return rows


def _deal(rows: list[list[int]], lengths: list[int], dp_size: int, per_rank: int) -> list[list[list[int]]]:
    """`rows` over `dp_size` ranks, `per_rank` each (rows split in two where there are too few)."""

    def tokens(row: list[int]) -> int:
        return sum(lengths[i] for i in row)

    while len(rows) < dp_size * per_rank:
        fullest = max((r for r in rows if len(r) > 1), key=tokens, default=None)
        if fullest is None:  # cannot happen: there are at least dp_size x per_rank samples
            raise AssertionError("too few samples to make the micro-batches")
        rows.remove(fullest)
        rows += _halves(fullest, lengths)
    plan: list[list[list[int]]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for row in sorted(rows, key=lambda r: (-tokens(r), r)):
        rank = min((r for r in range(dp_size) if len(plan[r]) < per_rank), key=lambda r: (load[r], r))
        plan[rank].append(row)
        load[rank] += tokens(row)
    return plan


def _halves(row: list[int], lengths: list[int]) -> list[list[int]]:
    """A row of several samples as two rows of about equal tokens (longest first, each to the lighter)."""
    parts: list[list[int]] = [[], []]
    weight = [0, 0]
    for i in sorted(row, key=lambda i: (-lengths[i], i)):
        side = 0 if weight[0] <= weight[1] else 1
        parts[side].append(i)
        weight[side] += lengths[i]
    return parts


def pack_row(
    samples: list[Sample], indices: list[int], advantages: list[float], length: int, pad_id: int = 0
) -> MicroBatch:
    """samples[indices] end to end in one row of `length` tokens; advantages[i] is sample i's."""
    chosen = [samples[i] for i in indices]
    used = sum(s.length for s in chosen)
    if used > length:
        raise ValueError(f"{used} tokens of samples do not fit a packed row of {length}")
    rows = new_rows(1, length, pad_id)
    bounds = [0]
    for s in chosen:
        bounds.append(bounds[-1] + s.length)
    fill_samples(rows, [(0, bounds[k], s, advantages[i]) for k, (i, s) in enumerate(zip(indices, chosen, strict=True))])
    if used < length:
        bounds.append(length)  # the tail: a segment of padding
    starts = torch.tensor(bounds[:-1]).repeat_interleave(torch.tensor(bounds).diff())
    position_ids = (torch.arange(length) - starts).unsqueeze(0)
    routes, route_mask = place_routes(chosen, 1, length, offsets=bounds[: len(chosen)])
    return MicroBatch(
        **rows,
        position_ids=position_ids,
        sample_index=list(indices),
        num_tokens=counted_tokens(chosen),
        routes=routes,
        route_mask=route_mask,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in itertools.pairwise(bounds)),
    )


def block_causal_mask(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """[1, 1, length, length] True where a query may NOT attend (Megatron's mask convention): keys
    of another segment, or later in its own."""
    segment = torch.arange(length, device=cu_seqlens.device)
    segment = torch.bucketize(segment, cu_seqlens[1:].to(segment), right=True)
    same = segment.unsqueeze(0) == segment.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=cu_seqlens.device).tril()
    return ~(same & causal).view(1, 1, length, length)


@dataclass(frozen=True)
class PaddedAttention:
    """Rows of one sample each: the model's own causal attention, nothing to add."""

    def inputs(self, mb: MicroBatch) -> dict:
        return {"attention_mask": None}


@dataclass(frozen=True)
class MaskedRowAttention:
    """Packed rows for the local attention: a block-diagonal causal mask over the row."""

    def inputs(self, mb: MicroBatch) -> dict:
        return {"attention_mask": block_causal_mask(mb.cu_seqlens, mb.input_ids.shape[1])}


@dataclass(frozen=True)
class ThdAttention:
    """Packed rows for Transformer Engine: THD with the segments' cu_seqlens."""

    def inputs(self, mb: MicroBatch) -> dict:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu, longest = mb.cu_seqlens, mb.max_seqlen
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
        return {"attention_mask": None, "packed_seq_params": params}


# ----------------------------------------------------------------------------------------------
# The two layouts: each plans a step over the data-parallel ranks and builds one rank's micro-batches.


@dataclass(frozen=True)
class PaddedLayout:
    """One sample a row, right-padded to the micro-batch's longest (to the step's largest micro-batch
    under a virtual pipeline, whose schedule needs one shape)."""

    budget: int
    sequence_multiple: int
    uniform: bool
    attention: PaddedAttention = PaddedAttention()

    def plan(self, lengths: list[int], dp_size: int, multiple_of: int) -> list[list[list[int]]]:
        return plan_microbatches(lengths, dp_size, self.budget, multiple_of)

    def build(self, samples: list[Sample], mine: list[list[int]], advantages: list[float]) -> list[MicroBatch]:
        shape = uniform_shape(samples, mine, self.sequence_multiple) if self.uniform else None
        return [pad_microbatch(samples, idx, advantages, self.sequence_multiple, shape=shape) for idx in mine]

    def computed_tokens(self, lengths: list[int], plan: list[list[list[int]]]) -> int:
        """Positions the step's forward passes run over, every rank's."""
        total = 0
        for mine in plan:
            if self.uniform:
                rows = max(len(idx) for idx in mine)
                seq = max(lengths[i] for idx in mine for i in idx)
                total += len(mine) * rows * _round_up(seq, self.sequence_multiple)
            else:
                total += sum(len(idx) * _round_up(max(lengths[i] for i in idx), self.sequence_multiple) for idx in mine)
        return total


@dataclass(frozen=True)
class PackedLayout:
    """Samples end to end in rows of at most the budget. Each row is as long as its samples (rounded
    up to the layout's sequence multiple); under a virtual pipeline, whose schedule carries one
    shape, every row of a rank is as long as its longest."""

    budget: int
    sequence_multiple: int
    uniform: bool
    attention: MaskedRowAttention | ThdAttention

    def plan(self, lengths: list[int], dp_size: int, multiple_of: int) -> list[list[list[int]]]:
        return plan_packed(lengths, dp_size, self.budget, multiple_of)

    def row_lengths(self, lengths: list[int], mine: list[list[int]]) -> list[int]:
        """The length of each of a rank's rows."""
        used = [_round_up(sum(lengths[i] for i in idx), self.sequence_multiple) for idx in mine]
        return [max(used)] * len(used) if self.uniform else used

    def build(self, samples: list[Sample], mine: list[list[int]], advantages: list[float]) -> list[MicroBatch]:
        rows = self.row_lengths([s.length for s in samples], mine)
        return [pack_row(samples, idx, advantages, length) for idx, length in zip(mine, rows, strict=True)]

    def computed_tokens(self, lengths: list[int], plan: list[list[list[int]]]) -> int:
        return sum(sum(self.row_lengths(lengths, mine)) for mine in plan)


def _round_up(n: int, multiple: int) -> int:
    return math.ceil(n / multiple) * multiple


def packing_leak(spec: ModelSpec, model: ModelConfig) -> str | None:
    """The kind of layer of the model that would mix the samples of a packed row under its attention
    implementation (Family.packing_leak), or None."""
    return family_of(spec).packing_leak(spec, model.transformer_impl == "transformer_engine")


def packs(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig) -> bool:
    """Whether parallel.packing packs: "auto" does with Transformer Engine (THD attention costs what
    the samples need) or a virtual pipeline (one shape a step), unless a layer of the model would mix
    a row's samples (packing_leak): then one sample a row, and "packed" is a ConfigError."""
    leak = packing_leak(spec, model)
    te = model.transformer_impl == "transformer_engine"
    if parallel.packing == "auto":
        return leak is None and (te or parallel.virtual_pipeline is not None)
    if parallel.packing == "packed" and leak is not None:
        raise ConfigError(
            "parallel.packing",
            "packed",
            f"{spec.architecture}'s {leak} would mix the samples of a packed row (model.transformer_impl="
            f"{model.transformer_impl}); use parallel.packing=auto, which trains one sample a row",
        )
    return parallel.packing == "packed"


def microbatch_layout(spec: ModelSpec, model: ModelConfig, parallel: ParallelConfig, sequence_multiple: int):
    """The layout the job's micro-batches take (PaddedLayout or PackedLayout)."""
    budget = parallel.max_tokens_per_microbatch
    if not packs(spec, model, parallel):
        return PaddedLayout(budget, sequence_multiple, uniform=parallel.virtual_pipeline is not None)
    attention = ThdAttention() if model.transformer_impl == "transformer_engine" else MaskedRowAttention()
    return PackedLayout(budget, sequence_multiple, parallel.virtual_pipeline is not None, attention)
