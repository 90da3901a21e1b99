"""The architecture facts of a Hugging Face config.json that Megatron and the weight maps need.

Pure Python: parsing and layout checks run before any process group or model exists.
Qwen2 / Qwen2.5 (Qwen2ForCausalLM) and Llama 3 (LlamaForCausalLM) are mapped; anything
else is a clear error naming what is not mapped.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from bapo_megatron.errors import ConfigError, check

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One decoder-only model's shape, as Megatron builds it."""

    architecture: Literal["qwen2", "llama"]
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    tie_embeddings: bool
    rope_scaling_factor: float | None = None
    """Llama 3.1-style RoPE scaling (low/high frequency factors 1 and 4, original length 8192)."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "head_dim",
            "max_position_embeddings",
        ):
            check(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        check(
            self.num_heads % self.num_kv_heads == 0,
            "num_key_value_heads",
            self.num_kv_heads,
            f"must divide num_attention_heads={self.num_heads}",
        )

    @property
    def query_groups(self) -> int:
        return self.num_kv_heads

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelSpec:
        """Parse a config.json mapping; ConfigError for architectures or features we do not map."""
        archs = hf.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ConfigError("architectures", archs, f"not mapped; supported: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[known[0]]
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in hf:
                raise ConfigError(key, None, "missing from config.json")
        heads = hf["num_attention_heads"]
        if hf.get("use_sliding_window", False):
            raise ConfigError("use_sliding_window", True, "sliding-window attention is not mapped")
        if arch == "llama":
            for key in ("attention_bias", "mlp_bias"):
                if hf.get(key, False):
                    raise ConfigError(key, True, "biases beyond q/k/v are not mapped")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            ffn_hidden_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch == "qwen2",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling_factor=_rope_scaling(hf.get("rope_scaling")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelSpec:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError("model.hf_path", str(path), "has no config.json")
        try:
            hf = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError("model.hf_path", str(file), f"config.json is not valid JSON ({err})") from None
        return cls.from_hf_config(hf)

    def to_hf_config(self) -> dict:
        """A config.json for this spec that transformers loads (used by tests and conversion)."""
        common = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.ffn_hidden_size,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling_factor is not None:
            common["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_scaling_factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        if self.architecture == "qwen2":
            return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            **common,
        }

    def as_dict(self) -> dict:
        return asdict(self)


def _rope_scaling(scaling: dict | None) -> float | None:
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


def tiny_spec(architecture: Literal["qwen2", "llama"] = "qwen2") -> ModelSpec:
    """The built-in model of the CPU demo and the tests: a few layers, GQA, a vocab that needs padding."""
    return ModelSpec(
        architecture=architecture,
        vocab_size=250,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=128,
        head_dim=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        qkv_bias=architecture == "qwen2",
        tie_embeddings=False,
    )


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int, pad_for_tp: int = 1) -> int:
    """The embedding's row count: vocab_size rounded up to a multiple of divisible_by * lcm(tp, pad_for_tp)."""
    multiple = divisible_by * math.lcm(tensor_parallel, pad_for_tp)
    return math.ceil(vocab_size / multiple) * multiple


def check_layout(spec: ModelSpec, tensor: int, pipeline: int, virtual_pipeline: int | None = None) -> None:
    """ConfigError unless the model splits evenly over this tensor/pipeline layout."""
    check(spec.num_heads % tensor == 0, "parallel.tensor", tensor, f"must divide the {spec.num_heads} attention heads")
    check(
        spec.num_kv_heads % tensor == 0,
        "parallel.tensor",
        tensor,
        f"must divide the {spec.num_kv_heads} query groups (key/value heads)",
    )
    check(
        spec.ffn_hidden_size % tensor == 0,
        "parallel.tensor",
        tensor,
        f"must divide the MLP width {spec.ffn_hidden_size}",
    )
    stages = pipeline * (virtual_pipeline or 1)
    check(
        spec.num_layers % stages == 0,
        "parallel.pipeline",
        pipeline,
        f"pipeline x virtual stages ({stages}) must divide the {spec.num_layers} layers",
    )
