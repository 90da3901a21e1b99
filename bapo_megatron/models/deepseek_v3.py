"""DeepSeek-V3 (DeepseekV3ForCausalLM; DeepSeek-V3/V3.1/R1, Kimi-K2 and Moonlight share it):
multi-latent attention (models/mla.py) in every layer, a dense MLP in the first first_k_dense_replace
layers and routed experts after them (models/moe.py: sigmoid scores with the expert-score correction
bias, grouped top-k, routed_scaling_factor, n_shared_experts shared experts as one MLP of
n x moe_intermediate_size); RoPE plain or YaRN (rope_scaling, DeepSeek-V3's and Kimi-K2's).

Checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the decoder
(`model.layers.{num_hidden_layers}.*`); the model here is the decoder without them (transformers
builds none either). Kimi-K2's config.json names model_type kimi_k2 with DeepseekV3ForCausalLM's code:
the hub's DeepSeek-style configs name their own code (auto_map), which is refused by name; with it
removed (and Kimi's model_type set to deepseek_v3) transformers' own classes load them.
DeepSeek-V3's and Kimi-K2's releases are fp8 with 128 x 128 block scales (quantization_config;
V3.1's ue8m0 scales too): read dequantized, their multi-token-prediction layers carried as stored,
exported in fp8 again (models/quantized.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bapo_megatron.errors import ConfigError, check
from bapo_megatron.models.family import (
    common_fields,
    common_hf,
    hook_topk_routers,
    read_yarn,
    rope_parameters,
    tiny_fields,
)
from bapo_megatron.models.features import LatentAttentionSpec, MoESpec, YarnSpec
from bapo_megatron.models.lora_targets import Layout, Target
from bapo_megatron.models.mla import LatentAttention, local_layer
from bapo_megatron.models.moe import GROUPED_REQUIRED, RoutedExperts, grouped_moe_hf, read_grouped_moe, tiny_grouped_moe
from bapo_megatron.models.on_disk import KeptTensors, extra_layers
from bapo_megatron.models.spec import ModelSpec

LATENT = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
"""Required by name: DeepseekV3Config's defaults are DeepSeek-V3's own widths (q_lora_rank 1536: a
config.json without the key has a query latent, which Moonlight's states null)."""
ROUTED = ("routed_scaling_factor", "n_group", "topk_group")
"""Required by name beside models/moe.GROUPED_REQUIRED: DeepseekV3Config defaults them to
DeepSeek-V3's 2.5, 8 and 4, GLM-4.5's config (and models/moe.read_grouped_moe) to 1.0, 1 and 1."""
SGLANG_PRE_SPLIT = (
    "SGLang's pre-split layout of multi-latent attention (its fused q/kv down-projections and "
    "absorbed up-projections) is not mapped; write a Hugging Face directory instead (no --sglang-tp): "
    "SGLang loads it at any TP and EP"
)


class DeepseekV3(RoutedExperts, LatentAttention):
    name = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    lora_experts = True  # the routed experts only: the shared experts and dense MLPs stay unadapted

    # -- config.json
    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        for key in LATENT:
            if key not in hf:
                raise ConfigError(key, None, "missing from config.json (DeepseekV3ForCausalLM)")
        if hf.get("attention_bias", False):
            raise ConfigError("attention_bias", True, "biases of the latent projections are not mapped")
        heads = hf["num_attention_heads"]
        if hf.get("num_key_value_heads") not in (None, heads):
            raise ConfigError(
                "num_key_value_heads",
                hf["num_key_value_heads"],
                f"multi-latent attention has a key and a value per head: must be num_attention_heads={heads}",
            )
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError("moe_layer_freq", hf["moe_layer_freq"], "only 1 (transformers' rule) is mapped")
        if hf.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError("scoring_func", hf["scoring_func"], "DeepSeek-V3's router scores with a sigmoid")
        if hf.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError("topk_method", hf["topk_method"], "only noaux_tc (the expert-score bias) is mapped")
        if self._first_routed(hf) < hf["num_hidden_layers"]:
            for key in GROUPED_REQUIRED + ROUTED:
                if key not in hf:
                    raise ConfigError(key, None, "missing from config.json (DeepseekV3ForCausalLM)")

    @staticmethod
    def _first_routed(hf: dict) -> int:
        dense = hf.get("first_k_dense_replace", 3)  # transformers' default
        check(isinstance(dense, int) and dense >= 0, "first_k_dense_replace", dense, "must be an integer >= 0")
        return dense

    def fields(self, hf: dict) -> dict[str, Any]:
        """Layer i has experts from first_k_dense_replace on (every layer dense when it is at least
        num_hidden_layers); the spec's head_dim is a query's (and key's) width per head."""
        scaling = rope_parameters(hf)
        plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
        plain["rope_theta"] = hf.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0))
        latent = LatentAttentionSpec(
            q_lora_rank=hf.get("q_lora_rank"),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            yarn=read_yarn(scaling, "DeepSeek-V3"),
        )
        return {
            **common_fields(plain),
            "architecture": self.name,
            "num_kv_heads": hf["num_attention_heads"],
            "head_dim": latent.qk_head_dim,
            "qkv_bias": False,
            "qk_norm": False,
            "latent_attention": latent,
            "moe": self._moe(hf),
        }

    def _moe(self, hf: dict) -> MoESpec | None:
        layers, first = hf["num_hidden_layers"], self._first_routed(hf)
        if first >= layers:
            return None
        return read_grouped_moe(hf, tuple(range(first, layers)), self.architectures[0])

    def kept_tensors(self, spec: ModelSpec, hf: dict) -> KeptTensors:
        """The multi-token-prediction layers after the decoder: carried and written back, not trained."""
        return extra_layers(hf)

    def to_hf(self, spec: ModelSpec) -> dict:
        mla = spec.latent_attention
        common = {k: v for k, v in common_hf(spec).items() if k not in ("head_dim", "rope_scaling")}
        config = {
            "architectures": list(self.architectures),
            "model_type": self.name,
            **common,
            "num_key_value_heads": spec.num_heads,
            "attention_bias": False,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "rope_interleave": mla.rope_interleave,
            "num_nextn_predict_layers": 0,
            **self._moe_hf(spec),
        }
        if mla.yarn is not None:
            config["rope_scaling"] = {"rope_type": "yarn", **dataclasses.asdict(mla.yarn)}
        return config

    def _moe_hf(self, spec: ModelSpec) -> dict[str, Any]:
        moe = spec.moe
        if moe is None:
            return {"first_k_dense_replace": spec.num_layers}
        return grouped_moe_hf(spec, self.name)

    def tiny(self) -> ModelSpec:
        """DeepSeek-V3's shape in small: query and kv latents, YaRN (factor 4 over 1024 positions, both
        mscales), 8 experts in 4 groups (top-4 from 2 groups), a shared expert, scaling 2.5, the first
        layer dense."""
        yarn = YarnSpec(factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=0.707)
        latent = LatentAttentionSpec(
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, yarn=yarn
        )
        fields = tiny_fields(self.name) | {"num_kv_heads": 4, "head_dim": latent.qk_head_dim}
        return ModelSpec(
            **fields, qkv_bias=False, latent_attention=latent, moe=tiny_grouped_moe(32, (1, 2, 3), top_k=4, groups=4)
        )

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The dense task model's hidden size, layers and heads with Moonlight's attention (a kv latent,
        queries without one, plain RoPE) and 8 experts of width 64 in 4 groups, top-4, a shared
        expert, the first layer dense (about 1.1M parameters)."""
        latent = LatentAttentionSpec(
            q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32
        )
        spec = super().task_model(vocab_size, max_positions)
        return dataclasses.replace(
            spec,
            num_kv_heads=spec.num_heads,
            head_dim=latent.qk_head_dim,
            latent_attention=latent,
            moe=tiny_grouped_moe(64, (1, 2, 3), top_k=4, groups=4),
        )

    def routed(self, spec: ModelSpec, layer: int) -> bool:
        return spec.moe is not None and spec.moe.is_sparse(layer)

    # -- Megatron
    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        if spec.moe is None:
            return LatentAttention.transformer_fields(self, spec)
        return super().transformer_fields(spec)

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """Dense: one MLA layer spec. Routed: Megatron's block spec, each layer's MLA made local."""
        if spec.moe is None:
            return LatentAttention.layer_spec(self, spec, te, config, vp_stage)
        block = super().layer_spec(spec, te, config, vp_stage)
        if te:
            return block
        return dataclasses.replace(block, layer_specs=[local_layer(layer) for layer in block.layer_specs])

    # -- LoRA
    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        """Multi-latent attention's projections (models/mla.py). Not the MLPs (a dense layer's, the
        shared experts'): peft 0.21 on transformers 5 reads gate_proj / up_proj / down_proj of this
        model as its fused routed experts' parameters (transformers_weight_conversion maps
        deepseek_v3 as qwen2_moe), so a dense or shared MLP adapter would not load there (GLM-4.5's
        rule)."""
        return self.latent_lora_targets(spec)

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        return self.latent_lora_layout(spec, module)

    # -- SGLang (models/deepseek_v2.py serves DeepSeek-V3)
    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        raise ValueError(SGLANG_PRE_SPLIT)

    def sglang_layer_shapes(self, spec: ModelSpec, layer: int, tp: int) -> dict[str, tuple[int, ...]]:
        raise ValueError(SGLANG_PRE_SPLIT)

    # -- the embedded engine
    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        return hook_topk_routers(model, record, DeepseekV3TopkRouter)
