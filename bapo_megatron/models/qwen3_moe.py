"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, routed experts (softmax router, top-k, no
shared expert) in the layers transformers gives them, a dense MLP in the others.

The routed layers' names and Megatron fields are models/moe.py's (RoutedExperts), with its defaults:
softmax scores, no expert bias, no groups, no shared expert.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bapo_megatron.errors import ConfigError, check
from bapo_megatron.models.family import common_hf, hook_topk_routers
from bapo_megatron.models.features import MoESpec
from bapo_megatron.models.moe import RoutedExperts
from bapo_megatron.models.qwen3 import Qwen3
from bapo_megatron.models.spec import ModelSpec


class Qwen3Moe(RoutedExperts, Qwen3):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    lora_experts = True
    peft_reads_mlp_as_experts = True

    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        if hf.get("shared_expert_intermediate_size"):
            size = hf["shared_expert_intermediate_size"]
            raise ConfigError("shared_expert_intermediate_size", size, "shared experts are not mapped")
        if "num_experts" not in hf and "num_local_experts" not in hf:
            raise ConfigError("num_experts", None, "missing from config.json (Qwen3MoeForCausalLM)")
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if key not in hf:
                raise ConfigError(key, None, "missing from config.json (Qwen3MoeForCausalLM)")

    def fields(self, hf: dict) -> dict[str, Any]:
        """Layer i has experts unless it is in mlp_only_layers or (i + 1) is not a multiple of
        decoder_sparse_step (transformers' rule)."""
        step = int(hf.get("decoder_sparse_step", 1))
        check(step >= 1, "decoder_sparse_step", step, "must be >= 1")
        dense = set(hf.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
        moe = MoESpec(
            # the hub's configs say num_experts; transformers 5 writes it as num_local_experts
            num_experts=int(hf.get("num_experts", hf.get("num_local_experts"))),
            top_k=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            sparse_layers=sparse,
        )
        return {**super().fields(hf), "moe": moe}

    def to_hf(self, spec: ModelSpec) -> dict:
        moe = spec.moe
        return {
            "architectures": list(self.architectures),
            "model_type": self.name,
            "attention_bias": False,
            "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.ffn_hidden_size,
            "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(spec.num_layers) if i not in moe.sparse_layers],
            **common_hf(spec),
        }

    def tiny(self) -> ModelSpec:
        """4 experts, top-2, every layer sparse but the first (a dense layer in a MoE model)."""
        moe = MoESpec(num_experts=4, top_k=2, ffn_hidden_size=32, norm_topk_prob=True, sparse_layers=(1, 2, 3))
        return ModelSpec(**{**super().tiny().as_dict(), "architecture": self.name, "moe": moe})

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The dense task model's shape with every layer 8 experts of width 128, top-2 (the same active
        MLP width as the dense 384 within a third), about 1.3M parameters."""
        moe = MoESpec(num_experts=8, top_k=2, ffn_hidden_size=128, norm_topk_prob=True, sparse_layers=(0, 1, 2, 3))
        return dataclasses.replace(super().task_model(vocab_size, max_positions), moe=moe)

    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        return hook_topk_routers(model, record, Qwen3MoeTopKRouter)
