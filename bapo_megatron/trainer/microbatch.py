"""Split a step's samples over data-parallel ranks and into padded micro-batches by token budget
(trainer/packing.py packs them into rows instead).

Samples are sorted by length and dealt to data-parallel ranks in snake order (equal counts,
balanced tokens); each rank groups its samples, longest first, into micro-batches whose
padded size (samples x longest) stays within the budget; then ranks with fewer
micro-batches split their fullest ones, so that every rank runs the same number (Megatron's
schedules and any collective inside the loss need that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bapo_megatron.common.batch import Sample


def plan_microbatches(lengths: list[int], dp_size: int, max_tokens: int, multiple_of: int = 1) -> list[list[list[int]]]:
    """plan[dp_rank][microbatch] = sample indices, every rank with the same number of micro-batches,
    a multiple of `multiple_of` (Megatron's interleaved schedule runs micro-batches in groups of
    the pipeline size)."""
    check_fits(lengths, dp_size, max_tokens)
    n = len(lengths)
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    for k, i in enumerate(order):
        lap, pos = divmod(k, dp_size)
        per_rank[pos if lap % 2 == 0 else dp_size - 1 - pos].append(i)
    plans = [_group_padded(indices, lengths, max_tokens) for indices in per_rank]
    target = math.ceil(max(len(p) for p in plans) / multiple_of) * multiple_of
    if target > n // dp_size:
        raise ValueError(
            f"{n // dp_size} samples per data-parallel rank cannot make {target} micro-batches (the "
            f"interleaved pipeline schedule runs them in groups of {multiple_of}): use more samples a step"
        )
    for plan in plans:
        while len(plan) < target:
            fullest = max(range(len(plan)), key=lambda j: len(plan[j]))
            mb = plan.pop(fullest)
            plan[fullest:fullest] = [mb[: len(mb) // 2], mb[len(mb) // 2 :]]
    return plans


def check_fits(lengths: list[int], dp_size: int, max_tokens: int) -> None:
    """ValueError unless the samples split evenly over the data-parallel ranks and each fits a
    micro-batch."""
    n = len(lengths)
    if n == 0 or n % dp_size:
        raise ValueError(f"{n} samples cannot be split evenly over {dp_size} data-parallel ranks")
    too_long = [(i, length) for i, length in enumerate(lengths) if length > max_tokens]
    if too_long:
        i, length = too_long[0]
        raise ValueError(
            f"sample {i} has {length} tokens, more than parallel.max_tokens_per_microbatch="
            f"{max_tokens} ({len(too_long)} such samples)"
        )


def _group_padded(indices: list[int], lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Longest first: a micro-batch takes samples while count x longest fits the budget."""
    batches: list[list[int]] = []
    for i in indices:  # already longest first
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def uniform_shape(samples: list[Sample], plan: list[list[int]], sequence_multiple: int = 1) -> tuple[int, int]:
    """(rows, seq) that holds every micro-batch of `plan` (one rank's): the interleaved pipeline
    schedule needs one activation shape for all micro-batches of a step."""
    rows = max(len(indices) for indices in plan)
    longest = max(samples[i].length for indices in plan for i in indices)
    return rows, math.ceil(longest / sequence_multiple) * sequence_multiple


@dataclass
class MicroBatch:
    """Padded [batch, seq] tensors of one micro-batch; position t predicts targets[:, t]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    """1.0 where targets[:, t] is a counted response token."""
    old_logprobs: torch.Tensor
    """Behaviour log-probs aligned with targets (0 where not counted)."""
    advantages: torch.Tensor
    versions: torch.Tensor
    """Policy version that sampled each target (-1 where not a response token)."""
    sample_index: list[int]
    num_tokens: int
    """Counted response tokens (loss_mask's sum), counted on the host when packed: the loss
    callbacks hand it to the schedule, and reading it back from the GPU would stall the host
    once a micro-batch."""
    prox_logprobs: torch.Tensor | None = None
    """log pi at the start of the step, filled by the trainer's forward-only pass when needed."""
    ref_logprobs: torch.Tensor | None = None
    """log pi_ref of the reference model (algo.kl_coef > 0), filled by the trainer's reference pass."""
    token_mask: torch.Tensor | None = None
    """[batch, seq] True at the samples' tokens (False at padding)."""
    routes: torch.Tensor | None = None
    """The engine's experts per position [batch, seq, moe_layers, top_k] (int64), when every sample
    has them; positions without one (each sample's last, padding) hold experts 0 .. top_k - 1."""
    route_mask: torch.Tensor | None = None
    """True where `routes` holds a recorded route."""
    cu_seqlens: torch.Tensor | None = None
    """A packed row's segment boundaries (int32 [segments + 1]: each sample's start, the tail's,
    the row's end); None: one sample a row."""
    max_seqlen: int = 0
    """A packed row's longest segment."""

    def to(self, device: torch.device | str) -> MicroBatch:
        fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**fields)


def new_rows(rows: int, seq: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The per-position tensors of a micro-batch of rows x seq, all padding."""
    return {
        "input_ids": torch.full((rows, seq), pad_id, dtype=torch.long),
        "targets": torch.full((rows, seq), pad_id, dtype=torch.long),
        "loss_mask": torch.zeros(rows, seq),
        "old_logprobs": torch.zeros(rows, seq),
        "advantages": torch.zeros(rows, seq),
        "versions": torch.full((rows, seq), -1, dtype=torch.long),
        "token_mask": torch.zeros(rows, seq, dtype=torch.bool),
    }


def fill_samples(rows: dict[str, torch.Tensor], placed: list[tuple[int, int, Sample, float]]) -> None:
    """Write each (row, start, sample, advantage) of `placed` into `rows` at [row, start:]: its
    tokens, and at the positions that predict its response tokens their targets, mask, behaviour
    log-probs, advantage and versions. One indexed write per tensor for all the samples: a write per
    sample and tensor cost the demo's step ~30 ms of CPU (2,000 small ops for 256 samples)."""
    seq = rows["input_ids"].shape[1]
    at, tokens, target_at, targets, span, mask, behaviour, advantages, versions = ([] for _ in range(9))
    for row, start, s, advantage in placed:
        ids, p, r = s.prompt_ids + s.response_ids, len(s.prompt_ids), len(s.response_ids)
        assert start + len(ids) <= seq, (row, start, len(ids), seq)  # else it would spill into the next row
        first = row * seq + start
        at += range(first, first + len(ids))
        tokens += ids
        target_at += range(first, first + len(ids) - 1)
        targets += ids[1:]
        span += range(first + p - 1, first + p - 1 + r)  # position p-1 predicts the first response token
        mask += s.loss_mask if s.loss_mask is not None else [1] * r
        behaviour += s.behaviour_logprobs
        advantages += [advantage] * r
        versions += s.versions
    flat = {name: t.view(-1) for name, t in rows.items()}
    at_index, span_index = torch.tensor(at, dtype=torch.long), torch.tensor(span, dtype=torch.long)
    flat["input_ids"][at_index] = torch.tensor(tokens, dtype=torch.long)
    flat["token_mask"][at_index] = True
    flat["targets"][torch.tensor(target_at, dtype=torch.long)] = torch.tensor(targets, dtype=torch.long)
    counted_mask = torch.tensor(mask, dtype=torch.float32)
    counted = counted_mask != 0
    flat["loss_mask"][span_index] = counted_mask
    flat["old_logprobs"][span_index] = torch.tensor(behaviour, dtype=torch.float32) * counted
    flat["advantages"][span_index] = torch.tensor(advantages, dtype=torch.float32) * counted
    flat["versions"][span_index] = torch.tensor(versions, dtype=torch.long)


def pad_microbatch(
    samples: list[Sample],
    indices: list[int],
    advantages: list[float],
    sequence_multiple: int = 1,
    pad_id: int = 0,
    shape: tuple[int, int] | None = None,
) -> MicroBatch:
    """Right-padded tensors for samples[indices]; advantages[i] is sample i's advantage. shape:
    (rows, seq) to pad to, at least what the samples need (rows past the samples count nothing)."""
    chosen = [samples[i] for i in indices]
    seq = math.ceil(max(s.length for s in chosen) / sequence_multiple) * sequence_multiple
    b = len(chosen)
    if shape is not None:
        if shape[0] < b or shape[1] < seq:
            raise ValueError(f"shape {shape} is smaller than the micro-batch's ({b}, {seq})")
        b, seq = shape
    rows = new_rows(b, seq, pad_id)
    fill_samples(rows, [(row, 0, s, advantages[i]) for row, (i, s) in enumerate(zip(indices, chosen, strict=True))])
    routes, route_mask = place_routes(chosen, b, seq)
    return MicroBatch(
        **rows,
        position_ids=torch.arange(seq).unsqueeze(0).expand(b, seq).contiguous(),
        sample_index=list(indices),
        num_tokens=counted_tokens(chosen),
        routes=routes,
        route_mask=route_mask,
    )


def counted_tokens(chosen: list[Sample]) -> int:
    """The response tokens the loss counts in `chosen`."""
    return int(sum(len(s.response_ids) if s.loss_mask is None else sum(s.loss_mask) for s in chosen))


def place_routes(
    chosen: list[Sample], rows: int, seq: int, offsets: list[int] | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Each sample's routes placed where its tokens lie in a micro-batch of [rows, seq]:
    ([rows, seq, moe_layers, top_k] routes, [rows, seq] mask of recorded ones), or (None, None)
    unless every sample has routes. offsets: each sample's start in row 0 (packed); None: sample k
    in row k from position 0 (padded)."""
    if not chosen or any(s.routes is None for s in chosen):
        return None, None
    layers, top_k = chosen[0].routes.shape[1:]
    routes = torch.arange(top_k).expand(rows, seq, layers, top_k).clone()
    mask = torch.zeros(rows, seq, dtype=torch.bool)
    for k, s in enumerate(chosen):
        row, start = (0, offsets[k]) if offsets is not None else (k, 0)
        n = s.routes.shape[0]
        routes[row, start : start + n] = s.routes.long()
        mask[row, start : start + n] = True
    return routes, mask
