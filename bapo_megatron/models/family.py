"""What a model family is, as the questions the rest of the package asks it (Family), and the
config.json parsing every family shares.

A family is one class in a module of its own (models/qwen2.py, ...), registered in
models/__init__.py; nothing outside models/ checks an architecture's features: it asks the family
of the spec (family_of(spec)) for its HF tensors, its Megatron names and recipes, its
TransformerConfig fields and layer spec, its SGLang pre-split tensors and its parameter counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models.recipes import Recipe
from bapo_megatron.models.spec import ModelSpec

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


class Family(ABC):
    """One model family: its names, its config.json reader, and the answers the package asks for.

    A subclass sets the class attributes and implements the questions below; a family that maps a
    feature of its config.json sets it in `fields`, one that does not refuses it by name in `refuse`."""

    name: ClassVar[str]
    """The spec's `architecture` and transformers' model_type."""
    architectures: ClassVar[tuple[str, ...]]
    """The HF architectures (config.json's `architectures`) it reads."""

    # -- config.json <-> ModelSpec
    def read(self, hf: dict, source: str | Path = "config.json") -> ModelSpec:
        """The spec of a config.json mapping read from `source`; ConfigError naming a feature not mapped."""
        if hf.get("model_type") != self.name:  # transformers builds the class of model_type, not of architectures
            arch = next(a for a in hf.get("architectures") or () if a in self.architectures)
            raise BadInputError(
                f"{source}: model_type {hf.get('model_type')!r} is not {self.name!r}, the model type of {arch}"
            )
        for key in REQUIRED:
            if key not in hf:
                raise ConfigError(key, None, "missing from config.json")
        self.refuse(hf)
        return ModelSpec(**self.fields(hf))

    def refuse(self, hf: dict) -> None:
        """ConfigError naming the first feature of `hf` that the Megatron build or the weight maps would
        silently get wrong."""
        if hf.get("use_sliding_window", False):
            raise ConfigError("use_sliding_window", True, "sliding-window attention is not mapped")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError("hidden_act", hf["hidden_act"], "only SiLU-gated MLPs (silu) are mapped")

    @abstractmethod
    def fields(self, hf: dict) -> dict[str, Any]:
        """ModelSpec's fields from a checked config.json."""
        raise NotImplementedError

    @abstractmethod
    def to_hf(self, spec: ModelSpec) -> dict:
        """A config.json for `spec` that transformers loads (used by tests and conversion)."""
        raise NotImplementedError

    @abstractmethod
    def tiny(self) -> ModelSpec:
        """The family's built-in tiny model (the CPU demo's and the tests')."""
        raise NotImplementedError

    @abstractmethod
    def routed(self, spec: ModelSpec, layer: int) -> bool:
        """Whether layer `layer` routes its tokens to experts."""
        raise NotImplementedError

    @abstractmethod
    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The tiny model `python -m bapo_megatron.tasks` writes for the family (about 1M parameters)."""
        raise NotImplementedError

    # -- tensors, by decoder layer (the embedding, final norm and lm_head are every family's)
    @abstractmethod
    def hf_layer_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        """Every HF tensor of layer `layer` (as checkpoints on disk name them) with its shape."""
        raise NotImplementedError

    @abstractmethod
    def layer_recipes(self, spec: ModelSpec, layer: int, impl: str, grouped: bool) -> dict[str, Recipe]:
        """Layer `layer`'s Megatron TP=1, EP=1 parameters (names of `impl`'s layer spec; experts grouped
        or one after another) with the recipe that makes each from HF tensors, in loading order."""
        raise NotImplementedError

    @abstractmethod
    def layer_to_hf(self, spec: ModelSpec, layer: int, mg: Mapping[str, Any], impl: str) -> Iterator[tuple[str, Any]]:
        """The inverse of layer_recipes: HF (name, tensor) pairs of layer `layer` read from Megatron
        names in `mg` (experts by global index, in either naming)."""
        raise NotImplementedError

    @abstractmethod
    def stored_layer_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer `layer`'s suffixes as a dist checkpoint stores them (Transformer Engine's norm names,
        experts stacked over a leading [experts] axis), with their whole (TP=1) shapes."""
        raise NotImplementedError

    @abstractmethod
    def norm_names(self, spec: ModelSpec, layer: int, impl: str) -> tuple[str, str]:
        """Layer `layer`'s attention and MLP norm weights under `impl`'s layer spec."""
        raise NotImplementedError

    # -- Megatron
    @abstractmethod
    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        """TransformerConfig's fields for the family's shape (the run's settings are added elsewhere)."""
        raise NotImplementedError

    @abstractmethod
    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """Megatron's layer (or block) spec: Transformer Engine modules when `te`, else the local ones."""
        raise NotImplementedError

    @abstractmethod
    def layer_params(self, spec: ModelSpec, layer: int) -> dict[str, int]:
        """Parameters of layer `layer` by how they are held: `tensor` (split over TP), `replicated`,
        `router` and `experts` (split over EP)."""
        raise NotImplementedError

    @abstractmethod
    def normed_qk_width(self, spec: ModelSpec) -> int:
        """Query and key elements per token that per-head q/k norms normalise (0: none), for the
        activation estimate."""
        raise NotImplementedError

    # -- SGLang
    @abstractmethod
    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        """ValueError unless SGLang's pre-split layout (`--load-format sharded_state`) at TP `tp` is mapped."""
        raise NotImplementedError

    @abstractmethod
    def sglang_layer_shapes(self, spec: ModelSpec, layer: int, tp: int) -> dict[str, tuple[int, ...]]:
        """Each TP rank's SGLang tensors of layer `layer` (its own module names) with their shapes."""
        raise NotImplementedError


# -- config.json parsing shared by the families


def common_fields(hf: dict) -> dict[str, Any]:
    """The ModelSpec fields every decoder reads the same way (the family adds its own)."""
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "ffn_hidden_size": hf["intermediate_size"],
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "rope_theta": float(rope_theta(hf)),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_scaling_factor": rope_scaling(rope_parameters(hf)),
    }


def common_hf(spec: ModelSpec) -> dict[str, Any]:
    """The config.json keys every decoder writes the same way."""
    common = {
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.ffn_hidden_size,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
    }
    if spec.rope_scaling_factor is not None:
        common["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": spec.rope_scaling_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
    return common


def tiny_fields(name: str) -> dict[str, Any]:
    """The tiny model's shape (a few layers, GQA, a vocab that needs padding) for family `name`."""
    return {
        "architecture": name,
        "vocab_size": 250,
        "hidden_size": 64,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 128,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_embeddings": False,
    }


def refuse_biases(hf: dict) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise ConfigError(key, True, "biases beyond Qwen2's q/k/v are not mapped")


def rope_parameters(hf: dict) -> dict | None:
    """RoPE scaling as config.json states it: transformers 5's rope_parameters or the older rope_scaling."""
    return hf.get("rope_scaling") or hf.get("rope_parameters")


def rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return hf["rope_theta"]
    return (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)


def rope_scaling(scaling: dict | None) -> float | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind != "llama3" or any(float(scaling.get(k, v)) != v for k, v in expected.items()):
        raise ConfigError(
            "rope_scaling", scaling, "only Llama 3.1-style scaling (low 1, high 4, original 8192) is mapped"
        )
    return float(scaling["factor"])
