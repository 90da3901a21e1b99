"""Mixture-of-experts weights in Hugging Face's two forms: per expert on disk, fused in memory.

Qwen3-MoE checkpoints (and SGLang's loader, and our exports) name each expert's projections
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`. transformers 5 holds a layer's experts
fused: `mlp.experts.gate_up_proj` [E, 2I, H] (expert E's gate rows, then its up rows) and
`mlp.experts.down_proj` [E, H, I]. This module maps one form onto the other, so that a model in
memory can take per-expert tensors one at a time (the embedded engine's weight updates) and its
state dict can be read per expert (tests, conversions).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertSlot:
    """Where one per-expert HF tensor lives inside a fused parameter: `param`[expert][rows]."""

    param: str
    expert: int
    rows: slice | None
    """gate: the first half of gate_up_proj's rows, up: the second; down: all of down_proj."""


def expert_slot(name: str, fused: Mapping[str, torch.Tensor]) -> ExpertSlot | None:
    """The fused slot of per-expert tensor `name` in a state dict `fused` (None: `name` is not a
    per-expert name, or the model keeps its experts per expert)."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, part = match[1], int(match[2]), match[3]
    param = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    if param not in fused:
        return None
    if part == "down":
        return ExpertSlot(param, expert, None)
    half = fused[param].shape[1] // 2
    return ExpertSlot(param, expert, slice(0, half) if part == "gate" else slice(half, 2 * half))


def slot_view(slot: ExpertSlot, fused: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The view of `fused`'s parameter that the per-expert tensor fills."""
    tensor = fused[slot.param][slot.expert]
    return tensor if slot.rows is None else tensor[slot.rows]


def hf_target(name: str, state: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The tensor of state dict `state` that HF tensor `name` fills: the entry itself, or for a
    per-expert name the view of its fused parameter; None when the model has no such tensor (an
    expert number past the fused parameter's experts included)."""
    if name in state:
        return state[name]
    slot = expert_slot(name, state)
    if slot is None or slot.expert >= state[slot.param].shape[0]:
        return None
    return slot_view(slot, state)


def per_expert(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """A state dict with fused experts as per-expert (name, tensor) pairs (views, no copies);
    every other entry as it is."""
    for name, tensor in state.items():
        match = _FUSED.match(name)
        if match is None or f"{match[1]}.gate_up_proj_bias" in state:  # gpt-oss's: fused on disk too
            yield name, tensor
            continue
        prefix, kind = match[1], match[2]
        for expert in range(tensor.shape[0]):
            if kind == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", tensor[expert]
            else:
                gate, up = tensor[expert].chunk(2)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up
