"""Qwen3 dense (Qwen3ForCausalLM): the decoder with an RMSNorm over each query and key head and a
head_dim of its own (Megatron's kv_channels), no biases."""

from __future__ import annotations

from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import common_hf, refuse_biases, tiny_fields
from bapo_megatron.models.lora_targets import Layout, Target, decoder_layout, decoder_targets
from bapo_megatron.models.spec import ModelSpec


class Qwen3(Decoder):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    qk_norm = True

    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        refuse_biases(hf)

    def to_hf(self, spec: ModelSpec) -> dict:
        head = {"architectures": list(self.architectures), "model_type": self.name}
        return {**head, "attention_bias": False, **common_hf(spec)}

    def tiny(self) -> ModelSpec:
        return ModelSpec(**tiny_fields(self.name), qkv_bias=False, qk_norm=True)

    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        return decoder_targets(spec, layer)

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        return decoder_layout(spec, layer, module)
