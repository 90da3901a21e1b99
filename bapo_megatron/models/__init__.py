"""The model families, one module each, and the one place that picks a family: by the spec's
architecture, or by a config.json's `architectures` (its `model_type` when it names none)."""

from __future__ import annotations

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.deepseek_v3 import DeepseekV3
from bapo_megatron.models.family import Family
from bapo_megatron.models.glm4_moe import Glm4Moe
from bapo_megatron.models.gpt_oss import GptOss
from bapo_megatron.models.llama import Llama
from bapo_megatron.models.qwen2 import Qwen2
from bapo_megatron.models.qwen3 import Qwen3
from bapo_megatron.models.qwen3_5 import Qwen3_5
from bapo_megatron.models.qwen3_5_moe import Qwen3_5Moe
from bapo_megatron.models.qwen3_moe import Qwen3Moe
from bapo_megatron.models.qwen3_next import Qwen3Next
from bapo_megatron.models.spec import ModelSpec

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Qwen2(),
        Llama(),
        Qwen3(),
        Qwen3Moe(),
        Glm4Moe(),
        Qwen3_5(),
        Qwen3_5Moe(),
        Qwen3Next(),
        DeepseekV3(),
        GptOss(),
    )
}
"""Every family by its name (the spec's architecture); a new family is one entry."""


def supported() -> list[str]:
    """The HF architectures the families read."""
    return sorted(a for family in FAMILIES.values() for a in family.architectures)


def family_of(spec: ModelSpec | str) -> Family:
    """The family of a spec (or of a family name)."""
    name = spec if isinstance(spec, str) else spec.architecture
    if name not in FAMILIES:
        raise ConfigError("architecture", name, f"no such model family; known: {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_for_hf(hf: dict) -> Family:
    """The family that reads a config.json: that of the first of its `architectures` a family reads,
    or, when it names none, the family whose model_type (its name) the text model's config states, in
    the family's disk layout (a multimodal config.json nests it: Qwen3.5's text_config); ConfigError
    naming both, and what is supported, when neither is mapped."""
    archs = hf.get("architectures") or []
    by_architecture = {a: family for family in FAMILIES.values() for a in family.architectures}
    known = [a for a in archs if a in by_architecture]
    if known:
        return by_architecture[known[0]]
    by_type = next((f for f in FAMILIES.values() if f.disk_layout(hf).model_type(hf) == f.name), None)
    if not archs and by_type is not None:
        return by_type
    model_type = hf.get("model_type")
    if by_type is not None:  # SGLang loads by architectures: one it has no class for would fail there
        said = f" (its model_type {model_type!r} is {by_type.architectures[0]}'s: name that)"
    else:
        said = f", nor model_type {model_type!r}" if model_type is not None else ""
    types = f"; with no architectures, a model_type of {sorted(FAMILIES)}"
    raise ConfigError("architectures", archs, f"not mapped{said}; supported: {supported()}{types}")


__all__ = ["FAMILIES", "Family", "family_for_hf", "family_of", "supported"]
