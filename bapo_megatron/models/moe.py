"""The routed-expert MLP the mixture-of-experts families share (RoutedExperts): a router (softmax or
sigmoid scores, an expert-score correction bias, grouped top-k, a scaling factor, as spec.moe says),
the experts, and a shared expert every token also goes through (gated or not).

A family is `class F(RoutedExperts, <its decoder>)`: the layers spec.moe makes sparse get the answers
below, the others the decoder's dense MLP; the attention part stays the decoder's, so a family with
another attention (latent, linear) reuses this one unchanged.

Names, per routed layer L (HF `model.layers.L.mlp.` -> Megatron `decoder.layers.L.mlp.`):
- `gate.weight` -> `router.weight`; `gate.e_score_correction_bias` -> `router.expert_bias`, which
  Megatron keeps as a float32 buffer (no gradient) and moves each step by moe_router_bias_update_rate:
  set to 0 here, the bias stays the checkpoint's (RL does not re-balance the experts' load).
- expert E's gate and up projections stack into its `linear_fc1`, its down projection is its
  `linear_fc2`, named `experts.local_experts.E.` (SequentialMLP) or `experts.linear_fc1.weightE`
  (Transformer Engine's grouped GEMM); a dist checkpoint stacks them over a leading [experts] axis.
  HF names are per expert, as on disk and in SGLang's loader (which fuses them itself).
- the shared expert (`shared_experts.` in DeepSeek-V3 and GLM-4.5, `shared_expert.` in Qwen3-Next:
  the family's `shared_hf`) is a dense gated MLP split over TP: `shared_experts.linear_fc1` [gate; up]
  and `linear_fc2`; its gate (`shared_expert_gate.weight`, [1, hidden]) is `shared_experts.gate_weight`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.features import MoESpec
from bapo_megatron.models.recipes import STORED_EXPERTS, Recipe, Rows, expert_names, grouped_experts, hf_expert_names
from bapo_megatron.models.spec import ModelSpec

SHARED = "mlp.shared_experts."
"""The shared expert's module in Megatron's MoE layer."""
FLOAT32 = ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")
"""HF and Megatron names of the tensors kept in float32 whatever the checkpoint's dtype: the expert
bias (Megatron keeps it float32, transformers and SGLang too; rounded to bfloat16, the bias would
move experts whose scores lie closer than its resolution)."""


class RoutedExperts:
    """The routed layers' answers of a decoder family (put it first among the bases: it defers to the
    decoder for dense layers)."""

    shared_hf: ClassVar[str] = "shared_experts"
    """The HF module of the shared expert under `mlp.` (when spec.moe has one)."""
    shared_gate_hf: ClassVar[str] = "shared_expert_gate"
    """The HF module of the shared expert's gate under `mlp.` (when spec.moe.shared_gate)."""

    def routed(self, spec: ModelSpec, layer: int) -> bool:
        return spec.moe.is_sparse(layer)

    def float32_tensor(self, name: str) -> bool:
        """The expert bias (FLOAT32)."""
        return name.endswith(FLOAT32)

    def _hf_router(self, layer: int) -> tuple[str, str]:
        """HF names of layer `layer`'s router weight and expert bias."""
        p = f"model.layers.{layer}.mlp.gate."
        return p + "weight", p + "e_score_correction_bias"

    def _hf_shared(self, layer: int) -> tuple[str, str, str, str]:
        """HF names of layer `layer`'s shared expert: gate, up and down projections, and its gate."""
        p = f"model.layers.{layer}.mlp."
        base = p + self.shared_hf + "."
        parts = tuple(base + f"{n}_proj.weight" for n in ("gate", "up", "down"))
        return (*parts, p + self.shared_gate_hf + ".weight")

    # -- HF tensors
    def _mlp_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        if not self.routed(spec, layer):
            return super()._mlp_hf_shapes(spec, layer)
        moe, d = spec.moe, spec.hidden_size
        weight, bias = self._hf_router(layer)
        shapes = {weight: (moe.num_experts, d)}
        if moe.expert_bias:
            shapes[bias] = (moe.num_experts,)
        if moe.shared_ffn_hidden_size:
            gate, up, down, shared_gate = self._hf_shared(layer)
            width = moe.shared_ffn_hidden_size
            shapes.update({gate: (width, d), up: (width, d), down: (d, width)})
            if moe.shared_gate:
                shapes[shared_gate] = (1, d)
        for e in range(moe.num_experts):
            gate, up, down = hf_expert_names(layer, e)
            shapes.update(
                {gate: (moe.ffn_hidden_size, d), up: (moe.ffn_hidden_size, d), down: (d, moe.ffn_hidden_size)}
            )
        return shapes

    # -- HF <-> Megatron
    def _mlp_recipes(self, spec: ModelSpec, layer: int, grouped: bool) -> dict[str, Recipe]:
        if not self.routed(spec, layer):
            return super()._mlp_recipes(spec, layer, grouped)
        moe, m = spec.moe, f"decoder.layers.{layer}."
        weight, bias = self._hf_router(layer)
        recipes: dict[str, Recipe] = {m + "mlp.router.weight": Rows((weight,))}
        if moe.expert_bias:
            recipes[m + "mlp.router.expert_bias"] = Rows((bias,))
        if moe.shared_ffn_hidden_size:
            gate, up, down, shared_gate = self._hf_shared(layer)
            recipes[m + SHARED + "linear_fc1.weight"] = Rows((gate, up))
            recipes[m + SHARED + "linear_fc2.weight"] = Rows((down,))
            if moe.shared_gate:
                recipes[m + SHARED + "gate_weight"] = Rows((shared_gate,))
        for expert in range(moe.num_experts):
            fc1, fc2 = expert_names(expert, grouped)
            gate, up, down = hf_expert_names(layer, expert)
            recipes[m + fc1] = Rows((gate, up))
            recipes[m + fc2] = Rows((down,))
        return recipes

    def _mlp_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The router, its bias and the shared expert first, then the experts one at a time (a
        checkpoint reader holds one expert at a time)."""
        if not self.routed(spec, layer):
            yield from super()._mlp_to_hf(spec, layer, mg)
            return
        moe, m = spec.moe, f"decoder.layers.{layer}."
        weight, bias = self._hf_router(layer)
        yield weight, mg[m + "mlp.router.weight"]
        if moe.expert_bias:
            yield bias, mg[m + "mlp.router.expert_bias"]
        if moe.shared_ffn_hidden_size:
            gate_name, up_name, down_name, shared_gate = self._hf_shared(layer)
            gate, up = mg[m + SHARED + "linear_fc1.weight"].chunk(2)
            yield from ((gate_name, gate), (up_name, up), (down_name, mg[m + SHARED + "linear_fc2.weight"]))
            if moe.shared_gate:
                yield shared_gate, mg[m + SHARED + "gate_weight"]
        grouped = grouped_experts(mg)
        for expert in range(moe.num_experts):
            fc1, fc2 = expert_names(expert, grouped)
            gate_name, up_name, down_name = hf_expert_names(layer, expert)
            gate, up = mg[m + fc1].chunk(2)
            yield from ((gate_name, gate), (up_name, up), (down_name, mg[m + fc2]))

    def _mlp_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        if not self.routed(spec, layer):
            return super()._mlp_stored_shapes(spec, layer)
        moe, d = spec.moe, spec.hidden_size
        shapes = {"mlp.router.weight": (moe.num_experts, d)}
        if moe.expert_bias:
            shapes["mlp.router.expert_bias"] = (moe.num_experts,)
        if moe.shared_ffn_hidden_size:
            width = moe.shared_ffn_hidden_size
            shapes.update({SHARED + "linear_fc1.weight": (2 * width, d), SHARED + "linear_fc2.weight": (d, width)})
            if moe.shared_gate:
                shapes[SHARED + "gate_weight"] = (1, d)
        shapes[STORED_EXPERTS[0]] = (moe.num_experts, 2 * moe.ffn_hidden_size, d)
        shapes[STORED_EXPERTS[1]] = (moe.num_experts, d, moe.ffn_hidden_size)
        return shapes

    def _mlp_params(self, spec: ModelSpec, layer: int, attention: dict[str, int]) -> dict[str, int]:
        """The shared expert is a dense MLP split over TP (its gate whole on every rank); the expert
        bias, never trained, counts with the router."""
        if not self.routed(spec, layer):
            return super()._mlp_params(spec, layer, attention)
        moe, d = spec.moe, spec.hidden_size
        router = moe.num_experts * d + (moe.num_experts if moe.expert_bias else 0)
        return attention | {
            "tensor": attention["tensor"] + 3 * d * moe.shared_ffn_hidden_size,
            "replicated": attention["replicated"] + (d if moe.shared_gate else 0),
            "router": router,
            "experts": moe.num_experts * 3 * d * moe.ffn_hidden_size,
        }

    # -- Megatron
    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        return super().transformer_fields(spec) | moe_fields(spec, self.routed)

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """A block spec (its layers differ: dense or experts), which needs the TransformerConfig and
        the virtual stage being built."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage)

    # -- SGLang
    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        raise ValueError(
            "SGLang's pre-split layout of a mixture-of-experts model (its fused experts) is not mapped; "
            "write a Hugging Face directory instead (no --sglang-tp): SGLang loads it at any TP and EP"
        )


def moe_fields(spec: ModelSpec, routed) -> dict[str, Any]:
    """TransformerConfig's fields for spec.moe's routers and experts; `routed(spec, layer)` says which
    layers have them."""
    moe = spec.moe
    fields: dict[str, Any] = {
        "num_moe_experts": moe.num_experts,
        "moe_router_topk": moe.top_k,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_layer_freq": [int(routed(spec, i)) for i in range(spec.num_layers)],
        "moe_router_score_function": moe.score_function,
        # softmax over all experts, then top-k, renormalised when norm_topk_prob: Megatron's pre-softmax
        # router is exactly the unnormalised case (sigmoid scores: features.MoESpec)
        "moe_router_pre_softmax": moe.score_function == "softmax" and not moe.norm_topk_prob,
        "moe_router_num_groups": moe.num_groups,
        "moe_router_group_topk": moe.group_top_k,
        "moe_router_topk_scaling_factor": None if moe.scaling_factor == 1.0 else moe.scaling_factor,
        "moe_shared_expert_intermediate_size": moe.shared_ffn_hidden_size or None,
        "moe_shared_expert_gate": moe.shared_gate,
    }
    if moe.expert_bias:
        # the bias chooses experts only; Megatron would move it towards balanced loads after every step
        fields |= {"moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0}
    return fields


# -- DeepSeek-V3's routed experts in config.json (DeepSeek-V3, GLM-4.5: the same keys, the same rules)

GROUPED_REQUIRED = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
"""The config.json keys of DeepSeek-style routed experts without a default anywhere."""


def read_grouped_moe(hf: dict, sparse: tuple[int, ...], architecture: str) -> MoESpec:
    """DeepSeek-style routed experts (sigmoid scores, the expert-score bias, grouped top-k, the scaling
    factor, n_shared_experts shared experts as one MLP of n x moe_intermediate_size) in the layers
    `sparse`, from config.json; groups every token may use all of (n_group == topk_group) limit
    nothing and are read as none. Keys missing take transformers' Glm4MoeConfig defaults: a family
    whose config class defaults otherwise requires them first."""
    for key in GROUPED_REQUIRED:
        if key not in hf:
            raise ConfigError(key, None, f"missing from config.json ({architecture})")
    groups, chosen = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    limited = chosen < groups
    width = int(hf["moe_intermediate_size"])
    return MoESpec(
        num_experts=int(hf["n_routed_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        ffn_hidden_size=width,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        sparse_layers=sparse,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups if limited else None,
        group_top_k=chosen if limited else None,
        scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_ffn_hidden_size=int(hf.get("n_shared_experts", 1)) * width,
    )


def grouped_moe_hf(spec: ModelSpec, family: str) -> dict[str, Any]:
    """The inverse of read_grouped_moe: config.json's keys for spec.moe, experts from one layer on
    (first_k_dense_replace); ValueError for experts a DeepSeek-style config.json cannot state."""
    moe, first = spec.moe, spec.moe.sparse_layers[0]
    if moe.sparse_layers != tuple(range(first, spec.num_layers)) or moe.shared_ffn_hidden_size % moe.ffn_hidden_size:
        raise ValueError(f"{family}: experts from one layer on and whole shared experts only ({moe})")
    return {
        "first_k_dense_replace": first,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "n_shared_experts": moe.shared_ffn_hidden_size // moe.ffn_hidden_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "routed_scaling_factor": moe.scaling_factor,
        "n_group": moe.num_groups or 1,
        "topk_group": moe.group_top_k or 1,
    }


def tiny_grouped_moe(width: int, sparse: tuple[int, ...], top_k: int, groups: int) -> MoESpec:
    """8 experts of `width` in `groups` groups, top-`top_k` from top_k / 2 of them (two experts a
    chosen group, DeepSeek-V3's ratio), a shared expert, scaling 2.5: the tiny models' experts."""
    return MoESpec(
        num_experts=8,
        top_k=top_k,
        ffn_hidden_size=width,
        norm_topk_prob=True,
        sparse_layers=sparse,
        score_function="sigmoid",
        expert_bias=True,
        num_groups=groups,
        group_top_k=top_k // 2,
        scaling_factor=2.5,
        shared_ffn_hidden_size=width,
    )
