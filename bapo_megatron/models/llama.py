"""Llama 3 / 3.1 (LlamaForCausalLM): the decoder without biases, Llama 3.1's RoPE scaling mapped."""

from __future__ import annotations

from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import common_hf, refuse_biases, tiny_fields
from bapo_megatron.models.spec import ModelSpec


class Llama(Decoder):
    name = "llama"
    architectures = ("LlamaForCausalLM",)

    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        refuse_biases(hf)

    def to_hf(self, spec: ModelSpec) -> dict:
        head = {"architectures": list(self.architectures), "model_type": self.name}
        return {**head, "attention_bias": False, "mlp_bias": False, **common_hf(spec)}

    def tiny(self) -> ModelSpec:
        return ModelSpec(**tiny_fields(self.name), qkv_bias=False, qk_norm=False)
