"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): the decoder's attention with q/k/v biases (attention_bias),
per-head q/k norms where use_qk_norm (GLM-4.5 and 4.6; not GLM-4.5-Air) and RoPE on the first half
of each head (partial_rotary_factor); DeepSeek-V3's routed experts (models/moe.py) in every layer from
first_k_dense_replace on: sigmoid scores with the expert-score correction bias, grouped top-k,
routed_scaling_factor and n_shared_experts shared experts (one MLP of n x moe_intermediate_size).

Checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the decoder
(`model.layers.{num_hidden_layers}.*`: eh_proj, enorm, hnorm, shared_head.norm and a whole MoE layer);
the model here is the decoder without them (transformers builds none either).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bapo_megatron.errors import ConfigError, check
from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import common_fields, common_hf, hook_topk_routers, tiny_fields
from bapo_megatron.models.lora_targets import Layout, Target, attention_targets, decoder_layout
from bapo_megatron.models.moe import RoutedExperts, grouped_moe_hf, read_grouped_moe, tiny_grouped_moe
from bapo_megatron.models.on_disk import KeptTensors, extra_layers
from bapo_megatron.models.spec import ModelSpec


class Glm4Moe(RoutedExperts, Decoder):
    name = "glm4_moe"
    architectures = ("Glm4MoeForCausalLM",)
    qkv_bias = True
    lora_experts = True

    # -- config.json
    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError("scoring_func", hf["scoring_func"], "GLM-4.5's router scores with a sigmoid")
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError("topk_method", hf["topk_method"], "only noaux_tc (the expert-score bias) is mapped")
        if hf.get("mlp_bias", False):
            raise ConfigError("mlp_bias", True, "MLP biases are not mapped")
        shared = hf.get("n_shared_experts", 1)
        check(isinstance(shared, int) and shared >= 0, "n_shared_experts", shared, "must be a count >= 0")

    def fields(self, hf: dict) -> dict[str, Any]:
        """Layer i has experts from first_k_dense_replace on (transformers' rule); groups that every token
        may use all of (n_group == topk_group, GLM-4.5's 1 and 1) limit nothing and are read as none."""
        layers, dense = hf["num_hidden_layers"], int(hf.get("first_k_dense_replace", 1))
        check(0 <= dense < layers, "first_k_dense_replace", dense, f"must leave a MoE layer of the {layers}")
        moe = read_grouped_moe(hf, tuple(range(dense, layers)), self.architectures[0])
        rope = hf.get("rope_parameters") or {}
        return {
            **common_fields(hf),
            "architecture": self.name,
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "qk_norm": bool(hf.get("use_qk_norm", False)),
            "rotary_fraction": float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.5))),
            "moe": moe,
        }

    def kept_tensors(self, spec: ModelSpec, hf: dict) -> KeptTensors:
        """The multi-token-prediction layers after the decoder: carried and written back, not trained."""
        return extra_layers(hf)

    def to_hf(self, spec: ModelSpec) -> dict:
        return {
            "architectures": list(self.architectures),
            "model_type": self.name,
            "attention_bias": spec.qkv_bias,
            "use_qk_norm": spec.qk_norm,
            "partial_rotary_factor": spec.rotary_fraction,
            **grouped_moe_hf(spec, self.name),
            "num_nextn_predict_layers": 0,
            **common_hf(spec),
        }

    def tiny(self) -> ModelSpec:
        """8 experts in 2 groups (top-2 from 1 group), a shared expert, scaling 2.5, the first layer dense;
        GLM-4.5-Air's attention (q/k/v biases, no q/k norm, RoPE on half of each head)."""
        moe = tiny_grouped_moe(32, (1, 2, 3), top_k=2, groups=2)
        return ModelSpec(**tiny_fields(self.name), qkv_bias=True, rotary_fraction=0.5, moe=moe)

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The dense task model's shape (q/k/v biases, half-rotary) with 8 experts of width 128 in 2
        groups, top-2, a shared expert, the first layer dense."""
        spec = super().task_model(vocab_size, max_positions)
        moe = tiny_grouped_moe(128, (1, 2, 3), top_k=2, groups=2)
        return dataclasses.replace(spec, qkv_bias=True, rotary_fraction=0.5, moe=moe)

    # -- the embedded engine
    # -- LoRA
    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        """The decoder's q/k/v/o (their biases stay the base's). Not the MLPs: peft 0.21 on transformers
        5 reads gate_proj / up_proj / down_proj of this model as its fused routed experts' parameters
        (transformers_weight_conversion), so a dense or shared MLP adapter would not load there."""
        return attention_targets(spec, spec.num_heads * spec.head_dim)

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        return decoder_layout(spec, layer, module)

    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

        return hook_topk_routers(model, record, Glm4MoeTopkRouter)
