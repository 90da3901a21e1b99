"""Qwen3.5 / Qwen3.6 MoE (qwen3_5_moe_text, and the released multimodal layout): Qwen3.5's hybrid of
Gated DeltaNet and gated full attention (models/qwen3_5.py), every layer's MLP routed experts beside
a gated shared expert (models/moe.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.family import hook_topk_routers
from bapo_megatron.models.features import MoESpec
from bapo_megatron.models.moe import RoutedExperts
from bapo_megatron.models.qwen3_5 import Qwen3_5
from bapo_megatron.models.spec import ModelSpec


class Qwen3_5Moe(RoutedExperts, Qwen3_5):
    """Qwen3.5 / Qwen3.6 MoE (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): Qwen3.5's hybrid
    attention, every layer's MLP routed experts (softmax, top-k renormalised) beside a shared expert
    scaled by sigmoid(shared_expert_gate) (models/moe.py)."""

    name = "qwen3_5_moe_text"
    architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    shared_hf = "shared_expert"
    lora_experts = True
    required = tuple(key for key in Qwen3_5.required if key != "intermediate_size")  # no dense layer, no width

    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if key not in hf:
                raise ConfigError(key, None, f"missing from config.json ({self.architectures[0]})")

    def _sparse_layers(self, hf: dict) -> tuple[int, ...]:
        """The layers with experts: every one (transformers gives each layer experts whatever
        mlp_only_layers says, so a config.json naming dense layers is refused)."""
        if hf.get("mlp_only_layers"):
            raise ConfigError("mlp_only_layers", hf["mlp_only_layers"], "dense layers in Qwen3.5-MoE are not mapped")
        return tuple(range(hf["num_hidden_layers"]))

    def fields(self, hf: dict) -> dict[str, Any]:
        moe = MoESpec(
            num_experts=int(hf["num_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=True,  # transformers' router always renormalises the top-k
            sparse_layers=self._sparse_layers(hf),
            shared_ffn_hidden_size=int(hf["shared_expert_intermediate_size"]),
            shared_gate=True,
        )
        # Qwen3_5MoeTextConfig has no intermediate_size (its released configs none): the spec's dense
        # width, which no layer uses, takes the experts' (Megatron's ffn_hidden_size must be set)
        return {**super().fields({"intermediate_size": moe.ffn_hidden_size, **hf}), "moe": moe}

    def to_hf(self, spec: ModelSpec) -> dict:
        moe = spec.moe
        return super().to_hf(spec) | {
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.ffn_hidden_size,
            "shared_expert_intermediate_size": moe.shared_ffn_hidden_size,
        }

    def tiny(self) -> ModelSpec:
        """Qwen3.5's tiny hybrid with 4 experts of 32, top-2, and a gated shared expert of 32 in every layer."""
        return dataclasses.replace(super().tiny(), architecture=self.name, moe=_small_moe(4, 32))

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The hybrid task model with 8 experts of 128, top-2, and a gated shared expert of 128."""
        dense = super().task_model(vocab_size, max_positions)
        return dataclasses.replace(dense, architecture=self.name, moe=_small_moe(8, 128))

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        return Qwen3_5.layer_spec(self, spec, te, config, vp_stage)

    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

        return hook_topk_routers(model, record, Qwen3_5MoeTopKRouter)


def _small_moe(experts: int, width: int) -> MoESpec:
    """The tiny and task models' experts: `experts` of `width` in each of the 4 layers, top-2
    renormalised, and a gated shared expert of `width`."""
    return MoESpec(
        num_experts=experts,
        top_k=2,
        ffn_hidden_size=width,
        norm_topk_prob=True,
        sparse_layers=(0, 1, 2, 3),
        shared_ffn_hidden_size=width,
        shared_gate=True,
    )
