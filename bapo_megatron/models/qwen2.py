"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): the decoder with q/k/v biases."""

from __future__ import annotations

from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import common_hf, tiny_fields
from bapo_megatron.models.spec import ModelSpec


class Qwen2(Decoder):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True

    def to_hf(self, spec: ModelSpec) -> dict:
        return {"architectures": list(self.architectures), "model_type": self.name, **common_hf(spec)}

    def tiny(self) -> ModelSpec:
        return ModelSpec(**tiny_fields(self.name), qkv_bias=True, qk_norm=False)
