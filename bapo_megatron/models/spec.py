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
from bapo_megatron.models.features import (
    LatentAttentionSpec,
    LinearAttentionSpec,
    MoESpec,
    SlidingWindowSpec,
    YarnSpec,
)

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
    "moe.score_function": "scoring_func",
    "moe.expert_bias": "e_score_correction_bias",
    "moe.num_groups": "n_group",
    "moe.group_top_k": "topk_group",
    "moe.scaling_factor": "routed_scaling_factor",
    "moe.shared_ffn_hidden_size": "n_shared_experts",
    "moe.shared_gate": "shared_expert_gate",
    "rotary_fraction": "partial_rotary_factor",
    "latent_attention.q_lora_rank": "q_lora_rank",
    "latent_attention.kv_lora_rank": "kv_lora_rank",
    "latent_attention.qk_nope_head_dim": "qk_nope_head_dim",
    "latent_attention.qk_rope_head_dim": "qk_rope_head_dim",
    "latent_attention.v_head_dim": "v_head_dim",
    "latent_attention.rope_interleave": "rope_interleave",
    "latent_attention.yarn.factor": "rope_scaling.factor",
    "latent_attention.yarn.original_max_position_embeddings": "rope_scaling.original_max_position_embeddings",
    "latent_attention.yarn.mscale": "rope_scaling.mscale",
    "latent_attention.yarn.mscale_all_dim": "rope_scaling.mscale_all_dim",
    "linear_attention": "layer_types",
    "sliding_window.size": "sliding_window",
    "sliding_window.layers": "layer_types",
    "attention_sinks": "architectures",
    "linear_bias": "attention_bias",
    "yarn.factor": "rope_scaling.factor",
    "yarn.original_max_position_embeddings": "rope_scaling.original_max_position_embeddings",
    "yarn.truncate": "rope_scaling.truncate",
    "linear_attention.layers": "layer_types",
    "linear_attention.num_key_heads": "linear_num_key_heads",
    "linear_attention.num_value_heads": "linear_num_value_heads",
    "linear_attention.key_head_dim": "linear_key_head_dim",
    "linear_attention.value_head_dim": "linear_value_head_dim",
    "linear_attention.conv_kernel_dim": "linear_conv_kernel_dim",
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
    rotary_fraction: float = 1.0
    """The share of each head's dims that RoPE rotates, the first ones (partial_rotary_factor;
    Megatron's rotary_percent)."""
    latent_attention: LatentAttentionSpec | None = None
    """Multi-latent attention in every layer (DeepSeek-V3); None: grouped-query attention."""
    linear_attention: LinearAttentionSpec | None = None
    """Gated DeltaNet in the layers it names (Qwen3.5); None: every layer full attention."""
    sliding_window: SlidingWindowSpec | None = None
    """Attention over the last positions only, in the layers it names (gpt-oss); None: none."""
    attention_sinks: bool = False
    """Each head's softmax has a learned logit of its own in its denominator (gpt-oss's sinks)."""
    yarn: YarnSpec | None = None
    """YaRN RoPE scaling of grouped-query attention (gpt-oss; multi-latent attention keeps its own)."""
    linear_bias: bool = False
    """The attention's output projection, the router and the experts have biases too (gpt-oss)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped SwiGLU: gate clamped above and up on both sides at this limit, then
    gate * sigmoid(1.702 gate) * (up + 1); None: SiLU(gate) * up."""

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
            0 < self.rotary_fraction <= 1 and (self.head_dim * self.rotary_fraction) % 2 == 0,
            "partial_rotary_factor",
            self.rotary_fraction,
            f"must lie in (0, 1] and rotate an even number of the head's {self.head_dim} dims",
        )
        check(
            self.num_heads % self.num_kv_heads == 0,
            "num_key_value_heads",
            self.num_kv_heads,
            f"must divide num_attention_heads={self.num_heads}",
        )
        if self.linear_attention is not None:
            check(
                all(0 <= i < self.num_layers for i in self.linear_attention.layers),
                "layer_types",
                self.linear_attention.layers,
                f"name linear-attention layers beyond the {self.num_layers}",
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
    """The embedding's row count: vocab_size rounded up to a multiple of divisible_by * lcm(tp, pad_for_tp).
    The alignment (divisible_by, for a GPU's GEMMs) is halved while one multiple would exceed the
    vocabulary, so that padding stays below the vocabulary's own size (down to lcm(tp, pad_for_tp)
    rows): the demo's 16 words stay 16 rows at TP 8, where 128 x 8 made its output layer 64 times
    wider than its vocabulary (a tenth of its CPU train step). A vocabulary of divisible_by x lcm
    words or more (every real one) is padded as Megatron pads it. The result depends on tp only
    through the lcm, so a checkpoint loads at every TP dividing pad_for_tp."""
    lcm = math.lcm(tensor_parallel, pad_for_tp)
    align = divisible_by
    while align > 1 and align * lcm > vocab_size:
        align //= 2
    multiple = align * lcm
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
    if spec.latent_attention is not None and sequence_parallel is not None:
        check(
            tensor == 1 or sequence_parallel,
            "parallel.sequence_parallel",
            sequence_parallel,
            f"must be true for multi-latent attention at tensor={tensor} (without it Megatron's MLA gets the "
            "gradients of the latent query norm and of the rotary key all heads share wrong)",
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
    _check_tensor_parallel(spec, tensor)
    stages = pipeline * (virtual_pipeline or 1)
    check(
        spec.num_layers % stages == 0,
        "parallel.pipeline",
        pipeline,
        f"pipeline x virtual stages ({stages}) must divide the {spec.num_layers} layers",
    )


def _check_tensor_parallel(spec: ModelSpec, tensor: int) -> None:
    """ConfigError unless TP `tensor` splits the heads, the query groups, the MLP and the linear-attention heads."""
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
    shared = spec.moe.shared_ffn_hidden_size if spec.moe is not None else 0
    check(shared % tensor == 0, "parallel.tensor", tensor, f"must divide the shared expert's width {shared}")
    if spec.linear_attention is not None:
        heads = spec.linear_attention.num_key_heads
        check(heads % tensor == 0, "parallel.tensor", tensor, f"must divide the {heads} linear-attention key heads")
