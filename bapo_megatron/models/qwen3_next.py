"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5-MoE's hybrid layers
(models/qwen3_5.py) with the delta rule's input projections grouped per key head and a dense MLP in
the layers transformers gives no experts."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.family import REQUIRED, hook_topk_routers
from bapo_megatron.models.qwen3_5 import IN_PROJ_PARTS, gdn_widths
from bapo_megatron.models.qwen3_5_moe import Qwen3_5Moe
from bapo_megatron.models.recipes import Fused, Recipe
from bapo_megatron.models.spec import ModelSpec


class Qwen3Next(Qwen3_5Moe):
    """Qwen3-Next (Qwen3NextForCausalLM): Qwen3.5-MoE's layers, but its delta rule's projections are
    grouped per key head (in_proj_qkvz: [q_g; k_g; v_g; z_g], in_proj_ba: [b_g; a_g] for each key
    head g), its experts in the layers transformers gives them (mlp_only_layers, decoder_sparse_step;
    a dense MLP in the others), the top-k renormalised as norm_topk_prob says."""

    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    required = REQUIRED  # its dense layers' width (mlp_only_layers, decoder_sparse_step)

    def lora_targets(self, spec: ModelSpec, layer: int) -> None:
        """Not built: its per-key-head in_proj_qkvz / in_proj_ba are no parts of Megatron's in_proj."""
        return None

    def _sparse_layers(self, hf: dict) -> tuple[int, ...]:
        """Layer i has experts unless it is in mlp_only_layers or (i + 1) is not a multiple of
        decoder_sparse_step (transformers' rule); the others are dense."""
        step, dense = int(hf.get("decoder_sparse_step", 1)), set(hf.get("mlp_only_layers") or [])
        if step < 1:
            raise ConfigError("decoder_sparse_step", step, "must be >= 1")
        return tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)

    def fields(self, hf: dict) -> dict[str, Any]:
        """The top-k renormalised as norm_topk_prob says (Qwen3.5-MoE's router always does)."""
        fields = super().fields(hf)
        norm = bool(hf.get("norm_topk_prob", True))
        return fields | {"moe": dataclasses.replace(fields["moe"], norm_topk_prob=norm)}

    def to_hf(self, spec: ModelSpec) -> dict:
        dense = [i for i in range(spec.num_layers) if not spec.moe.is_sparse(i)]
        extra = {"norm_topk_prob": spec.moe.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": dense}
        return super().to_hf(spec) | extra

    def tiny(self) -> ModelSpec:
        """Qwen3.5-MoE's tiny model with a dense first layer."""
        spec = super().tiny()
        return dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, sparse_layers=(1, 2, 3)))

    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextTopKRouter

        return hook_topk_routers(model, record, Qwen3NextTopKRouter)

    def _in_proj_hf_shapes(self, spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
        d, (qk, v, heads) = spec.hidden_size, gdn_widths(spec)
        return {p + "in_proj_qkvz.weight": (2 * qk + 2 * v, d), p + "in_proj_ba.weight": (2 * heads, d)}

    def _in_proj_parts(self, spec: ModelSpec, p: str) -> tuple[tuple[str, Recipe], ...]:
        qkvz, ba = _key_head_groups(spec)
        parts = [
            (part, Fused(partial(_group_part, qkvz, i), (p + "in_proj_qkvz.weight",)))
            for i, part in enumerate(IN_PROJ_PARTS[:4])
        ]
        parts += [
            (part, Fused(partial(_group_part, ba, i), (p + "in_proj_ba.weight",)))
            for i, part in enumerate(IN_PROJ_PARTS[4:])
        ]
        return tuple(parts)

    def _in_proj_to_hf(self, spec: ModelSpec, p: str, parts: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        groups = spec.linear_attention.num_key_heads
        yield p + "in_proj_qkvz.weight", _grouped(groups, parts[:4])
        yield p + "in_proj_ba.weight", _grouped(groups, parts[4:])


def _key_head_groups(spec: ModelSpec) -> tuple[list[int], list[int]]:
    """Rows per key head of Qwen3-Next's in_proj_qkvz (q, k, v, z) and in_proj_ba (b, a)."""
    la = spec.linear_attention
    ratio = la.num_value_heads // la.num_key_heads
    return [la.key_head_dim] * 2 + [ratio * la.value_head_dim] * 2, [ratio] * 2


def _group_part(sizes: list[int], index: int, tensor: torch.Tensor) -> torch.Tensor:
    """Part `index` of every key head's group of rows (sizes per group), the heads in order."""
    grouped = tensor.reshape(-1, sum(sizes), tensor.shape[-1])
    return grouped.split(sizes, dim=1)[index].reshape(-1, tensor.shape[-1])


def _grouped(groups: int, parts: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of _group_part: each key head's rows of every part, one head after another."""
    hidden = parts[0].shape[-1]
    return torch.cat([t.reshape(groups, -1, hidden) for t in parts], dim=1).reshape(-1, hidden)
