"""The architecture facts of a Hugging Face config.json that Megatron and the weight maps need.

Pure Python: parsing and layout checks run before any process group or model exists.
Qwen2 / Qwen2.5 (Qwen2ForCausalLM), Llama 3 (LlamaForCausalLM), Qwen3 (Qwen3ForCausalLM: q/k
RMSNorm over each head, head_dim of its own) and Qwen3-MoE (Qwen3MoeForCausalLM: routed experts,
no shared expert) are mapped; anything else, and any feature of theirs not mapped (shared
experts, sliding windows, a RoPE scaling other than Llama 3.1's, biases beyond q/k/v), is a clear
error naming it before any model is built. So is a config that would have transformers import code
from the model's directory (refuse_remote_code): nothing of a received directory is ever run.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from bapo_megatron.errors import BadInputError, ConfigError, check

ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
Architecture = Literal["qwen2", "llama", "qwen3", "qwen3_moe"]
"""Each also the model_type transformers builds that architecture for."""
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

    def flat(value: object, prefix: str) -> dict[str, object]:
        if not isinstance(value, dict):
            return {prefix: value}
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}").items()}

    return {k.removeprefix("."): v for k, v in flat(json.loads(json.dumps(asdict(spec))), "").items()}


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
    """One decoder-only model's shape, as Megatron builds it."""

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

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-based layer `layer` routes its tokens to experts."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @property
    def query_groups(self) -> int:
        return self.num_kv_heads

    @classmethod
    def from_hf_config(cls, hf: dict, source: str | Path = "config.json") -> ModelSpec:
        """Parse a config.json mapping read from `source`; ConfigError for architectures or features we
        do not map, BadInputError naming `source` for one that would run code of its directory."""
        refuse_remote_code(hf, source)
        archs = hf.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURES]
        if not known:
            raise ConfigError("architectures", archs, f"not mapped; supported: {sorted(ARCHITECTURES)}")
        arch = ARCHITECTURES[known[0]]
        if hf.get("model_type") != arch:  # transformers builds the class of model_type, not of architectures
            raise BadInputError(
                f"{source}: model_type {hf.get('model_type')!r} is not {arch!r}, the model type of {known[0]}"
            )
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if key not in hf:
                raise ConfigError(key, None, "missing from config.json")
        heads = hf["num_attention_heads"]
        _refuse_unmapped(arch, hf)
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
            rope_theta=float(_rope_theta(hf)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=arch == "qwen2",
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling_factor=_rope_scaling(_rope_parameters(hf)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            moe=_moe(hf) if arch == "qwen3_moe" else None,
        )

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
        if self.architecture == "qwen3":
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, **common}
        if self.architecture == "qwen3_moe":
            moe = self.moe
            step_one = tuple(range(self.num_layers))
            return {
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "attention_bias": False,
                "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": moe.ffn_hidden_size,
                "norm_topk_prob": moe.norm_topk_prob,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in step_one if i not in moe.sparse_layers],
                **common,
            }
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            **common,
        }

    def as_dict(self) -> dict:
        return asdict(self)


def _refuse_unmapped(arch: str, hf: dict) -> None:
    """ConfigError naming the first feature of `hf` that the Megatron build or the weight maps would
    silently get wrong."""
    if hf.get("use_sliding_window", False):
        raise ConfigError("use_sliding_window", True, "sliding-window attention is not mapped")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError("hidden_act", hf["hidden_act"], "only SiLU-gated MLPs (silu) are mapped")
    if arch in ("llama", "qwen3", "qwen3_moe"):
        for key in ("attention_bias", "mlp_bias"):
            if hf.get(key, False):
                raise ConfigError(key, True, "biases beyond Qwen2's q/k/v are not mapped")
    if arch == "qwen3_moe":
        if hf.get("shared_expert_intermediate_size"):
            raise ConfigError(
                "shared_expert_intermediate_size",
                hf["shared_expert_intermediate_size"],
                "shared experts are not mapped",
            )
        if "num_experts" not in hf and "num_local_experts" not in hf:
            raise ConfigError("num_experts", None, "missing from config.json (Qwen3MoeForCausalLM)")
        for key in ("num_experts_per_tok", "moe_intermediate_size"):
            if key not in hf:
                raise ConfigError(key, None, "missing from config.json (Qwen3MoeForCausalLM)")


def _moe(hf: dict) -> MoESpec:
    """Qwen3-MoE's experts; layer i has them unless it is in mlp_only_layers or (i + 1) is not a
    multiple of decoder_sparse_step (transformers' rule)."""
    step = int(hf.get("decoder_sparse_step", 1))
    check(step >= 1, "decoder_sparse_step", step, "must be >= 1")
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)
    return MoESpec(
        # the hub's configs say num_experts; transformers 5 writes it as num_local_experts
        num_experts=int(hf.get("num_experts", hf.get("num_local_experts"))),
        top_k=int(hf["num_experts_per_tok"]),
        ffn_hidden_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        sparse_layers=sparse,
    )


def _rope_parameters(hf: dict) -> dict | None:
    """RoPE scaling as config.json states it: transformers 5's rope_parameters or the older rope_scaling."""
    return hf.get("rope_scaling") or hf.get("rope_parameters")


def _rope_theta(hf: dict) -> float:
    if "rope_theta" in hf:
        return hf["rope_theta"]
    return (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)


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


def tiny_spec(architecture: Architecture = "qwen2") -> ModelSpec:
    """The built-in model of the CPU demo and the tests: a few layers, GQA, a vocab that needs padding;
    "qwen3_moe": 4 experts, top-2, every layer sparse but the first (a dense layer in a MoE model)."""
    moe = None
    if architecture == "qwen3_moe":
        moe = MoESpec(num_experts=4, top_k=2, ffn_hidden_size=32, norm_topk_prob=True, sparse_layers=(1, 2, 3))
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
        qk_norm=architecture in ("qwen3", "qwen3_moe"),
        moe=moe,
    )


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
