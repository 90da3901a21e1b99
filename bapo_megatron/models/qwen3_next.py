"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5-MoE's hybrid layers
(models/qwen3_5.py) with the delta rule's input projections grouped per key head and a dense MLP in
the layers transformers gives no experts. LoRA adapts the attention and the delta rule's projections
(each grouped projection's adapter's rows reordered into Megatron's in_proj parts)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.family import REQUIRED, hook_topk_routers
from bapo_megatron.models.lora_targets import Layout, Target, attention_targets
from bapo_megatron.models.qwen3_5 import GDN, IN_PROJ_PARTS, gdn_widths
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
    lora_experts = True  # transformers 5's Qwen3NextExperts: Qwen3-MoE's fused [E, 2w, d] / [E, d, w]

    def lora_experts_unserved(self, spec: ModelSpec) -> str | None:
        """SGLang 0.5.23's Qwen3NextForCausalLM has no get_hidden_dim: the experts' targets gate_up_proj
        and down_proj also wrap the shared expert's, whose LoRA buffers the fallback sizes by
        intermediate_size (the dense MLP's), and set_lora_info refuses a buffer unlike its layer."""
        dense, shared = spec.ffn_hidden_size, spec.moe.shared_ffn_hidden_size
        if not shared or shared == dense:
            return None
        return (
            f"SGLang 0.5.23's Qwen3NextForCausalLM sizes the shared expert's gate_up_proj/down_proj LoRA "
            f"buffers (wrapped by the experts' targets) by intermediate_size {dense}, not its "
            f"shared_expert_intermediate_size {shared} (it has no get_hidden_dim), and refuses to start"
        )

    # -- LoRA
    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        """Gated full attention's q/k/v/o (Qwen3.5's), or the delta rule's in_proj_qkvz, in_proj_ba and
        out_proj. Not the MLPs (a dense layer's, the shared expert's): peft 0.21 on transformers 5
        reads gate_proj / up_proj / down_proj of this model as its fused routed experts' parameters
        (transformers_weight_conversion maps qwen3_next as qwen2_moe). SGLang 0.5.23's
        Qwen3NextForCausalLM has no LoRA dimensions of its own (get_hidden_dim): the default it falls
        back to refuses in_proj_qkvz and out_proj, knows no in_proj_ba, and stacks q/k/v into a
        qkv_proj without the output gate's rows; of these it serves o_proj alone."""
        if not self._linear(spec, layer):
            attention = attention_targets(spec, 2 * spec.num_heads * spec.head_dim)
            return {n: t if n == "o_proj" else dataclasses.replace(t, served=False) for n, t in attention.items()}
        d, (qk, v, heads) = spec.hidden_size, gdn_widths(spec)
        p, module = "linear_attn.", GDN + "in_proj"
        return {
            "in_proj_qkvz": Target(
                "in_proj_qkvz", p + "in_proj_qkvz", module, "column", d, 2 * qk + 2 * v, served=False
            ),
            "in_proj_ba": Target("in_proj_ba", p + "in_proj_ba", module, "column", d, 2 * heads, served=False),
            "out_proj": Target("out_proj", p + "out_proj", GDN + "out_proj", "row", v, d, served=False),
        }

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        """in_proj: HF's rows per key head ([q_g; k_g; v_g; z_g], [b_g; a_g]), Megatron's part by part
        ([q; k; v; z; b; a], each part split over TP by key heads): a rank's rows of B are a slice."""
        if module != GDN + "in_proj":
            return super().lora_layout(spec, layer, module)
        (qk, v, heads), (qkvz, ba) = gdn_widths(spec), _key_head_groups(spec)
        grouped = (("in_proj_qkvz", tuple(qkvz)), ("in_proj_ba", tuple(ba)))
        return Layout(1, (("in_proj_qkvz", 2 * qk + 2 * v), ("in_proj_ba", 2 * heads)), "widths", grouped=grouped)

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
