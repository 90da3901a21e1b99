"""How a Megatron tensor is made from HF tensors: stacked rows, or a function of several (q/k/v
interleaving, vocabulary padding); the families' name maps are dicts of these.

Megatron fuses q, k and v into one `linear_qkv` whose rows are interleaved per query group: for
each key/value head g, the rows of its heads_per_group query heads, then its key head, then its
value head. The gated MLP's `linear_fc1` is [gate; up].
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from bapo_megatron.models.spec import ModelSpec


@dataclass(frozen=True)
class Rows:
    """A Megatron tensor made of HF tensors stacked by rows (one HF tensor: itself)."""

    names: tuple[str, ...]

    def __call__(self, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if len(self.names) == 1:
            return hf[self.names[0]]
        return torch.cat([hf[name] for name in self.names])

    def block(self, hf: Mapping[str, torch.Tensor], start: int, rows: int) -> torch.Tensor | None:
        """The HF tensor that is exactly rows [start, start + rows), when one is (no copy)."""
        at = 0
        for name in self.names:
            tensor = hf[name]
            if at == start and tensor.shape[0] == rows:
                return tensor
            at += tensor.shape[0]
        return None


@dataclass(frozen=True)
class Fused:
    """A Megatron tensor computed from several HF tensors (q/k/v interleaving, vocabulary padding)."""

    fn: Callable[..., torch.Tensor]
    names: tuple[str, ...]

    def __call__(self, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.fn(*(hf[name] for name in self.names))


@dataclass(frozen=True)
class Parts:
    """A Megatron tensor whose TP shards are no slices of it: Megatron's checkpoints split it into
    parts with keys of their own (`<key>.<part>`: Gated DeltaNet's in_proj and conv1d), each
    sharded over TP on its own, so a rank holds a slice of every part. The whole (TP = 1) tensor
    is the parts stacked by rows; a shard's region is one of a part's (`part`, by its key)."""

    parts: tuple[tuple[str, Rows | Fused], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for _, recipe in self.parts for n in recipe.names))

    def __call__(self, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([recipe(hf) for _, recipe in self.parts])

    def part(self, key: str) -> Rows | Fused:
        """The recipe of the part a sharded tensor's key ends in."""
        name = key.rsplit(".", 1)[-1]
        for part, recipe in self.parts:
            if part == name:
                return recipe
        raise ValueError(f"{key}: not one of the parts {[p for p, _ in self.parts]}")


Recipe = Rows | Fused | Parts


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[q; k; v] in Megatron's per-query-group interleaving (weights [rows, hidden] or biases [rows])."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    tail = q.shape[1:]
    parts = [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
    return torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * d, *tail)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *tail).split([per_group * d, d, d], dim=1)
    return (q.reshape(spec.num_heads * d, *tail), k.reshape(groups * d, *tail), v.reshape(groups * d, *tail))


def pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] > padded:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows does not fit the padded size {padded}")
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])


def norm_names(impl: str, moe_layer: bool = False) -> tuple[str, str]:
    """A layer's two RMSNorm weights under `impl`'s layer spec: Transformer Engine fuses them into the
    following linear layer, except before a MoE layer's experts (`pre_mlp_layernorm` under either)."""
    if impl == "transformer_engine":
        mlp = "pre_mlp_layernorm.weight" if moe_layer else "mlp.linear_fc1.layer_norm_weight"
        return "self_attention.linear_qkv.layer_norm_weight", mlp
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


STORED_EXPERTS = ("mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight")
"""A layer's experts as a dist checkpoint stores them: one tensor over the global experts each."""


def expert_names(expert: int, grouped: bool) -> tuple[str, str]:
    """The Megatron suffixes (within a layer) of expert `expert`'s fc1 and fc2 weights."""
    if grouped:
        return f"mlp.experts.linear_fc1.weight{expert}", f"mlp.experts.linear_fc2.weight{expert}"
    base = f"mlp.experts.local_experts.{expert}."
    return base + "linear_fc1.weight", base + "linear_fc2.weight"


def hf_expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of expert `expert`'s gate, up and down projections in layer `layer`."""
    base = f"model.layers.{layer}.mlp.experts.{expert}."
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


_GROUPED = re.compile(r"mlp\.experts\.linear_fc[12]\.weight\d+$")


def grouped_experts(names: Iterable[str]) -> bool:
    """Whether a model's experts are Transformer Engine's grouped GEMM (from its parameter names)."""
    return any(_GROUPED.search(n) for n in names)
