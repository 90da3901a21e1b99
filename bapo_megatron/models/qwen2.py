"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): the decoder with q/k/v biases."""

from __future__ import annotations

from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import common_hf, tiny_fields
from bapo_megatron.models.lora_targets import Layout, Target, decoder_layout, decoder_targets
from bapo_megatron.models.spec import ModelSpec


class Qwen2(Decoder):
    name = "qwen2"
    architectures = ("Qwen2ForCausalLM",)
    qkv_bias = True

    def to_hf(self, spec: ModelSpec) -> dict:
        return {"architectures": list(self.architectures), "model_type": self.name, **common_hf(spec)}

    def tiny(self) -> ModelSpec:
        return ModelSpec(**tiny_fields(self.name), qkv_bias=True, qk_norm=False)

    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        return decoder_targets(spec, layer)

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        return decoder_layout(spec, layer, module)
