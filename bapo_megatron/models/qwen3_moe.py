"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention, routed experts (softmax router, top-k, no
shared expert) in the layers transformers gives them, a dense MLP in the others.

Megatron: `moe_router_pre_softmax = not norm_topk_prob`; HF `mlp.gate` is `mlp.router`; expert E's
gate and up projections stack into its `linear_fc1`, its down projection is its `linear_fc2`, named
`mlp.experts.local_experts.E.` (SequentialMLP) or `mlp.experts.linear_fc1.weightE` (Transformer
Engine's grouped GEMM); a dist checkpoint stacks them over a leading [experts] axis. HF names are
per expert, as on disk and in SGLang's loader (which fuses them itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from bapo_megatron.errors import ConfigError, check
from bapo_megatron.models.family import common_hf
from bapo_megatron.models.qwen3 import Qwen3
from bapo_megatron.models.recipes import STORED_EXPERTS, Recipe, Rows, expert_names, grouped_experts, hf_expert_names
from bapo_megatron.models.spec import ModelSpec, MoESpec


class Qwen3Moe(Qwen3):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)

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

    def routed(self, spec: ModelSpec, layer: int) -> bool:
        return spec.moe.is_sparse(layer)

    def _mlp_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        if not self.routed(spec, layer):
            return super()._mlp_hf_shapes(spec, layer)
        d, width = spec.hidden_size, spec.moe.ffn_hidden_size
        shapes = {f"model.layers.{layer}.mlp.gate.weight": (spec.moe.num_experts, d)}
        for e in range(spec.moe.num_experts):
            gate, up, down = hf_expert_names(layer, e)
            shapes.update({gate: (width, d), up: (width, d), down: (d, width)})
        return shapes

    def _mlp_recipes(self, spec: ModelSpec, layer: int, grouped: bool) -> dict[str, Recipe]:
        if not self.routed(spec, layer):
            return super()._mlp_recipes(spec, layer, grouped)
        m = f"decoder.layers.{layer}."
        recipes: dict[str, Recipe] = {m + "mlp.router.weight": Rows((f"model.layers.{layer}.mlp.gate.weight",))}
        for expert in range(spec.moe.num_experts):
            fc1, fc2 = expert_names(expert, grouped)
            gate, up, down = hf_expert_names(layer, expert)
            recipes[m + fc1] = Rows((gate, up))
            recipes[m + fc2] = Rows((down,))
        return recipes

    def _mlp_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if not self.routed(spec, layer):
            yield from super()._mlp_to_hf(spec, layer, mg)
            return
        m = f"decoder.layers.{layer}."
        yield f"model.layers.{layer}.mlp.gate.weight", mg[m + "mlp.router.weight"]
        grouped = grouped_experts(mg)
        for expert in range(spec.moe.num_experts):
            fc1, fc2 = expert_names(expert, grouped)
            gate_name, up_name, down_name = hf_expert_names(layer, expert)
            gate, up = mg[m + fc1].chunk(2)
            yield gate_name, gate
            yield up_name, up
            yield down_name, mg[m + fc2]

    def _mlp_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        if not self.routed(spec, layer):
            return super()._mlp_stored_shapes(spec, layer)
        experts, width, d = spec.moe.num_experts, spec.moe.ffn_hidden_size, spec.hidden_size
        return {
            "mlp.router.weight": (experts, d),
            STORED_EXPERTS[0]: (experts, 2 * width, d),
            STORED_EXPERTS[1]: (experts, d, width),
        }

    def _mlp_params(self, spec: ModelSpec, layer: int, attention: dict[str, int]) -> dict[str, int]:
        if not self.routed(spec, layer):
            return super()._mlp_params(spec, layer, attention)
        moe, d = spec.moe, spec.hidden_size
        return attention | {"router": moe.num_experts * d, "experts": moe.num_experts * 3 * d * moe.ffn_hidden_size}

    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        moe = spec.moe
        return super().transformer_fields(spec) | {
            "num_moe_experts": moe.num_experts,
            "moe_router_topk": moe.top_k,
            "moe_ffn_hidden_size": moe.ffn_hidden_size,
            # Qwen3-MoE: softmax over all experts, then top-k, renormalised when norm_topk_prob;
            # Megatron's pre-softmax router is exactly the unnormalised case
            "moe_router_pre_softmax": not moe.norm_topk_prob,
            "moe_layer_freq": [int(self.routed(spec, i)) for i in range(spec.num_layers)],
        }

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """A block spec (its layers differ: dense or experts), which needs the TransformerConfig and
        the virtual stage being built."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage)

    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        raise ValueError(
            "SGLang's pre-split layout of a mixture-of-experts model (its fused experts) is not mapped; "
            "write a Hugging Face directory instead (no --sglang-tp): SGLang loads it at any TP and EP"
        )
