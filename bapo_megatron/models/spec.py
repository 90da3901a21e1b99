"""ModelSpec: the architecture facts of a Hugging Face config.json that Megatron and the weight maps
need, as a plain typed value; its family (models/) reads and writes config.json.

Pure Python: parsing and layout checks run before any process group or model exists. Which
architectures are mapped, and which of their features, is the families' (models/__init__.py):
anything else is a clear error naming it before any model is built. So is a config that would have
transformers import code from the model's directory (refuse_remote_code): nothing of a received
directory is ever run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from bapo_megatron.config.loader import dotted
from bapo_megatron.errors import BadInputError, ConfigError, check

Architecture = str
"""A family's name (models/__init__.FAMILIES), also the model_type transformers builds it for."""
REMOTE_CODE = "auto_map"
"""The key of a HF config (config.json, tokenizer_config.json) that names Python files of its own
directory for transformers to import."""
HF_FIELDS = {
    "architecture": "architectures",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "ffn_hidden_size": "intermediate_size",
    "qkv_bias": "architectures",
    "qk_norm": "architectures",
    "tie_embeddings": "tie_word_embeddings",
    "rope_scaling_factor": "rope_scaling.factor",
    "moe": "num_experts",
    "moe.num_experts": "num_experts",
    "moe.top_k": "num_experts_per_tok",
    "moe.ffn_hidden_size": "moe_intermediate_size",
    "moe.sparse_layers": "mlp_only_layers",
}
"""ModelSpec fields by the config.json key that sets them (the others have the same name)."""


def refuse_remote_code(config: object, source: str | Path) -> None:
    """BadInputError naming `source` when a HF config file (a model's config.json, a checkpoint's
    hf_config.json, tokenizer_config.json) has an auto_map: transformers would import the Python
    files it names from the directory (after a [y/N] question on a terminal). The mapped models
    need no such code, and a received directory's code is never run."""
    if isinstance(config, dict) and REMOTE_CODE in config:
        raise BadInputError(
            f"{source}: its {REMOTE_CODE} names code of the model's directory for transformers to import "
            f"({_shown(config[REMOTE_CODE])}); refusing it: the mapped models need none (remove {REMOTE_CODE})"
        )


def _shown(value: object, limit: int = 120) -> str:
    text = json.dumps(value) if isinstance(value, dict | list | str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def spec_fields(spec: ModelSpec) -> dict[str, object]:
    """The spec's fields, dotted (moe.top_k) and as JSON holds them (tuples as lists): a run.json's
    model.* entries are these."""

    return dotted(json.loads(json.dumps(asdict(spec))))


def first_difference(ours: dict[str, object], theirs: dict[str, object]) -> tuple[str, object, object] | None:
    """(config.json key, our value, their value) of the first field two spec_fields (or a run.json's
    model.* entries) both hold and disagree on; None when they agree."""
    for key in ours:
        if key in theirs and ours[key] != theirs[key]:
            return HF_FIELDS.get(key, key), ours[key], theirs[key]
    return None


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The routed experts of a mixture-of-experts model (Qwen3-MoE: softmax router, top-k, no shared expert)."""

    num_experts: int
    top_k: int
    ffn_hidden_size: int
    """Each expert's MLP width (moe_intermediate_size)."""
    norm_topk_prob: bool
    """The top-k probabilities are renormalised to sum to 1 (Megatron: softmax after top-k)."""
    sparse_layers: tuple[int, ...]
    """0-based indices of the layers whose MLP is the experts (the others are dense)."""

    def __post_init__(self) -> None:
        check(self.num_experts >= 2, "num_experts", self.num_experts, "must be >= 2")
        check(1 <= self.top_k <= self.num_experts, "num_experts_per_tok", self.top_k, "must lie in [1, num_experts]")
        check(self.ffn_hidden_size >= 1, "moe_intermediate_size", self.ffn_hidden_size, "must be >= 1")
        check(bool(self.sparse_layers), "mlp_only_layers", self.sparse_layers, "leave no layer with experts")

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One decoder-only model's shape, as Megatron builds it. `architecture` names its family
    (models/); qkv_bias and qk_norm are the family's facts, recorded (run.json) but read only there."""

    architecture: Architecture
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
    qk_norm: bool = False
    """RMSNorm of each query and key head before RoPE (Qwen3)."""
    moe: MoESpec | None = None
    """The routed experts (None: every layer dense)."""

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
        if self.moe is not None:
            check(
                max(self.moe.sparse_layers) < self.num_layers,
                "mlp_only_layers",
                self.moe.sparse_layers,
                f"name layers beyond the {self.num_layers}",
            )

    @classmethod
    def from_hf_config(cls, hf: dict, source: str | Path = "config.json") -> ModelSpec:
        """Parse a config.json mapping read from `source`; ConfigError for architectures or features we
        do not map, BadInputError naming `source` for one that would run code of its directory."""
        from bapo_megatron.models import family_for_hf

        refuse_remote_code(hf, source)
        return family_for_hf(hf).read(hf, source)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelSpec:
        file = Path(path) / "config.json"
        if not Path(path).is_dir():
            cwd = Path.cwd()
            where = "" if Path(path).is_absolute() else f" (a relative path is taken from the working directory, {cwd})"
            raise ConfigError("model.hf_path", str(path), f"no such directory{where}")
        if not file.is_file():
            raise ConfigError("model.hf_path", str(path), "has no config.json")
        try:
            hf = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError("model.hf_path", str(file), f"config.json is not valid JSON ({err})") from None
        return cls.from_hf_config(hf, file)

    def to_hf_config(self) -> dict:
        """A config.json for this spec that transformers loads (used by tests and conversion)."""
        from bapo_megatron.models import family_of

        return family_of(self).to_hf(self)

    def as_dict(self) -> dict:
        return asdict(self)


def tiny_spec(architecture: Architecture = "qwen2") -> ModelSpec:
    """The built-in model of the CPU demo and the tests: a few layers, GQA, a vocab that needs padding
    (its family's tiny(): "qwen3_moe" has 4 experts, top-2, every layer sparse but the first)."""
    from bapo_megatron.models import family_of

    return family_of(architecture).tiny()


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int, pad_for_tp: int = 1) -> int:
    """The embedding's row count: vocab_size rounded up to a multiple of divisible_by * lcm(tp, pad_for_tp)."""
    multiple = divisible_by * math.lcm(tensor_parallel, pad_for_tp)
    return math.ceil(vocab_size / multiple) * multiple


def check_layout(
    spec: ModelSpec,
    tensor: int,
    pipeline: int,
    virtual_pipeline: int | None = None,
    expert: int = 1,
    sequence_parallel: bool | None = None,
) -> None:
    """ConfigError unless the model splits evenly over this tensor/pipeline/expert layout (and, for
    training, sequence_parallel not None: a MoE model at TP > 1 trains only with sequence parallel)."""
    for field, size in (("parallel.tensor", tensor), ("parallel.pipeline", pipeline), ("parallel.expert", expert)):
        check(size >= 1, field, size, "must be >= 1")
    check(
        virtual_pipeline is None or virtual_pipeline >= 1, "parallel.virtual_pipeline", virtual_pipeline, "must be >= 1"
    )
    if spec.moe is not None and sequence_parallel is not None:
        check(
            tensor == 1 or sequence_parallel,
            "parallel.sequence_parallel",
            sequence_parallel,
            f"must be true for a mixture-of-experts model at tensor={tensor} (Megatron's MoE layer refuses "
            "to train with tensor parallel and no sequence parallel)",
        )
    if spec.moe is None:
        check(expert == 1, "parallel.expert", expert, "needs a mixture-of-experts model (this one is dense)")
    else:
        check(
            spec.moe.num_experts % expert == 0,
            "parallel.expert",
            expert,
            f"must divide the {spec.moe.num_experts} experts",
        )
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
