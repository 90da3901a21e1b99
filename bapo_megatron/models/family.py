"""What a model family is, as the questions the rest of the package asks it (Family), and the
config.json parsing every family shares.

A family is one class in a module of its own (models/qwen2.py, ...), registered in
models/__init__.py; nothing outside models/ checks an architecture's features: it asks the family
of the spec (family_of(spec)) for its HF tensors, its Megatron names and recipes, its
TransformerConfig fields and layer spec, its SGLang pre-split tensors and its parameter counts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models.features import YarnSpec
from bapo_megatron.models.lora_targets import Layout, Target
from bapo_megatron.models.on_disk import TEXT_LAYOUT, DiskLayout, KeptTensors
from bapo_megatron.models.quantized import read_quantization
from bapo_megatron.models.recipes import Recipe
from bapo_megatron.models.spec import ModelSpec

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


@dataclass(frozen=True)
class AttentionMemory:
    """What one layer's attention keeps for backward per token of a micro-batch, in elements of the
    parameters' dtype but `fp32` (the activation estimate's units, trainer/memory/estimate.py)."""

    split: int
    """Per-head tensors, split over TP (q, k, v, the context, a gate)."""
    fp32: int = 0
    """Per-head tensors kept in fp32 whatever the parameters' dtype, split over TP."""
    sequence: int = 0
    """Tensors of a width every TP rank holds whole (latents and their norms), split over TP only
    under sequence parallel, like the layer's norms."""
    rotary: int = 0
    """Whole on every TP rank whatever the layout: the rotary embedding's cos and sin (local modules)."""
    scores: bool = True
    """A softmax over the tokens (local modules); False for a recurrent layer (Gated DeltaNet)."""
    fused: bool = False
    """That softmax runs in torch's fused kernel (models/local_attention.py): no [heads, tokens, tokens]
    tensor kept; False: Megatron's op by op, which keeps its probabilities (gpt-oss' sinks and window)."""


class Family(ABC):
    """One model family: its names, its config.json reader, and the answers the package asks for.

    A subclass sets the class attributes and implements the questions below; a family that maps a
    feature of its config.json sets it in `fields`, one that does not refuses it by name in `refuse`."""

    name: ClassVar[str]
    """The spec's `architecture` and transformers' model_type."""
    architectures: ClassVar[tuple[str, ...]]
    """The HF architectures (config.json's `architectures`) it reads."""
    required: ClassVar[tuple[str, ...]] = REQUIRED
    """The config.json keys it cannot read without (transformers' config class has no default)."""
    dequantized: ClassVar[str] = "convert the checkpoint to bf16 first"
    """How to get an unquantized copy of a release whose quantization_config is not read
    (models/quantized.py reads fp8 block scales and mxfp4)."""
    local_attention_fused: ClassVar[bool] = True
    """Its local modules' core attention runs in torch's fused kernel (models/local_attention.py);
    False where it keeps Megatron's op-by-op softmax (sink logits, a sliding window)."""

    # -- config.json <-> ModelSpec
    def read(self, hf: dict, source: str | Path = "config.json") -> ModelSpec:
        """The spec of a config.json mapping read from `source` (its text model's part, in the family's
        disk layout); ConfigError naming a feature not mapped."""
        # the whole config.json's (a multimodal one states it on top): fp8 block scales and mxfp4 are
        # dequantized on load (models/quantized.py), any other scheme refused by name
        read_quantization(hf, self.dequantized)
        text = self.disk_layout(hf).text_part(hf, source)
        if text.get("model_type") != self.name:  # transformers builds the class of model_type, not of architectures
            arch = next(a for a in hf.get("architectures") or () if a in self.architectures)
            raise BadInputError(
                f"{source}: model_type {text.get('model_type')!r} is not {self.name!r}, the model type of {arch}"
            )
        for key in self.required:
            if key not in text:
                raise ConfigError(key, None, "missing from config.json")
        self.refuse(text)
        return ModelSpec(**self.fields(text))

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

    # -- checkpoints on disk (common/hf_io.py, weights/convert.py: every HF reader and writer asks these)
    def disk_layout(self, hf: dict) -> DiskLayout:
        """Where a checkpoint with config.json `hf` holds the text model: its tensors' prefix on disk and
        the key nesting its config (the default: a causal LM's, model.* and config.json itself)."""
        return TEXT_LAYOUT

    def kept_tensors(self, spec: ModelSpec, hf: dict) -> KeptTensors:
        """The on-disk tensors of a checkpoint with config.json `hf` that the trainer carries but does
        not train (a vision tower, multi-token-prediction layers: models/on_disk.extra_layers), written
        back untouched on export; any other tensor beyond the text model's is refused. Default: none."""
        return KeptTensors()

    def float32_tensor(self, name: str) -> bool:
        """Whether tensor `name` (HF or Megatron naming, a dist checkpoint's key too) is stored in
        float32 in a checkpoint of any dtype, as Megatron keeps it (an expert bias). Default: none."""
        return False

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

    def config_class(self, spec: ModelSpec) -> type:
        """Megatron's config class the fields are for: TransformerConfig, or a subclass of it for
        layers that need one (multi-latent attention's MLATransformerConfig)."""
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig

    @abstractmethod
    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """Megatron's layer (or block) spec: Transformer Engine modules when `te`, else the local ones
        (a family that builds one kind only refuses the other in check_impl, which it calls)."""
        raise NotImplementedError

    def check_impl(self, spec: ModelSpec, te: bool) -> None:
        """ConfigError naming model.transformer_impl unless layer_spec builds the family's layers from
        Transformer Engine's modules (`te`) or Megatron's local ones (not `te`); the dry run asks it
        too (preflight.validate), so both refuse alike. Default: both are built."""
        return

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

    def attention_memory(self, spec: ModelSpec, layer: int, local: bool, selective: bool) -> AttentionMemory:
        """What layer `layer`'s attention keeps for backward per token (the activation estimate):
        under Transformer Engine's fused layers, or Megatron's `local` modules op by op (with core
        attention recomputed when `selective`). Default: grouped-query attention, counted in
        trainer/memory/estimate.py's local_layer_bytes (measured on CPU, benchmarks/bench_memory.py)."""
        h, kv, hd, qk = spec.num_heads, spec.num_kv_heads, spec.head_dim, self.normed_qk_width(spec)
        qkv = (h + 2 * kv) * hd
        if not local:  # q/k/v, the attention output and linear_proj's input, the normalised q and k
            return AttentionMemory(split=qkv + 2 * h * hd + qk)
        # v, a view of the q/k/v output, keeps that whole; q and k after rope; linear_proj's input
        inputs = qkv + h * hd + kv * hd + h * hd
        if selective:  # core attention recomputed: it keeps its inputs only
            split, fp32 = inputs, 0
        elif self.local_attention_fused:  # the kernel's output, and its log-sum-exp a head (fp32)
            split, fp32 = inputs + h * hd, h
        elif h > kv:  # Megatron's: q after rope, k and v repeated to every head, the context
            split, fp32 = 4 * h * hd, 0
        else:
            split, fp32 = qkv + 3 * h * hd, 0
        # a q/k norm: its input, x * rsqrt, output
        return AttentionMemory(split + 3 * qk, fp32, rotary=4 * hd, fused=self.local_attention_fused)

    def engine_cache_bytes(self, spec: ModelSpec, tp: int, dtype_bytes: int = 2) -> int:
        """Bytes one token's cache takes on one SGLang rank at TP `tp`, every layer (the dry run's KV
        budget): the keys and values of the key/value heads, split over TP (SGLang replicates a head
        over the ranks when there are fewer heads than ranks)."""
        return 2 * spec.num_layers * kv_heads_per_rank(spec, tp) * spec.head_dim * dtype_bytes

    def engine_state_bytes(self, spec: ModelSpec, tp: int) -> int:
        """Bytes one request's recurrent state takes on one SGLang rank at TP `tp`, whatever its
        length (a linear-attention layer's; SGLang holds it in a pool of request slots beside the
        KV cache). Default: 0, every layer caches by position."""
        return 0

    # -- packed rows (trainer/packing.py)
    def packing_leak(self, spec: ModelSpec, te: bool) -> str | None:
        """The kind of layer that would mix the samples of a packed row, as the error and the dry run
        name it (e.g. "Gated DeltaNet linear attention": its recurrent state crosses the row's sample
        boundaries), under Transformer Engine's THD attention with cu_seqlens (`te`) or the local
        block-diagonal mask; None when every layer keeps the samples apart. The trainer then trains
        one sample a row: parallel.packing=auto falls back, parallel.packing=packed is refused."""
        return None

    # -- the embedded engine (engines/embedded/)
    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        """Hook the routers of `model` (the family's transformers model) so that each forward calls
        record(slot, indices) once per routed layer, indices [tokens, top_k] over the forward's
        batch x positions (row-major), slot the layer's ordinal among the routed ones. Returns the
        routed layers' indices in slot order: (), the default, for a dense model (nothing hooked)."""
        return ()

    def engine_differences(self, spec: ModelSpec) -> tuple[str, ...]:
        """Where the family's transformers model of `spec`, which the embedded engine serves, computes
        otherwise than the trainer and SGLang (each said once, as a warning, when the engine loads
        it). Default: nowhere."""
        return ()

    def cache_by_position(self, spec: ModelSpec) -> bool:
        """Whether every layer's cache in the family's transformers model is keys and values by
        position, which the embedded engine cuts at a request's length, pads and moves between
        slots (True, the default). A recurrent state (linear attention, Gated DeltaNet) holds every
        position at once, a sliding window's cache drops the oldest (False): the engine then runs
        each request alone over a cache of its own and rebuilds a continued request's state from
        its tokens."""
        return True

    # -- LoRA (models/lora.py asks)
    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target] | None:
        """The projections of layer `layer` LoRA can adapt, by HF name, each with its Megatron module
        and TP split; None: LoRA is not built for the family (refused by name). Default: None."""
        return None

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        """Where each target's rows are in the output of the fused column-parallel `module` of layer
        `layer` that lora_targets names (the whole layer's; Layout.rank: a TP rank's)."""
        raise NotImplementedError(f"{self.name} has no LoRA targets")

    peft_reads_mlp_as_experts: ClassVar[bool] = False
    """Whether peft 0.21 on transformers 5 takes this family's gate_proj / up_proj / down_proj targets
    for its routed experts' fused tensors (its weight conversion): a dense layer's MLP adapter is then
    not loaded from a PEFT adapter directory (weights/peft_export.py refuses to write one)."""

    lora_experts: ClassVar[bool] = False
    """Whether LoRA adapts its routed experts (model.lora.experts; models/lora_experts.py): its HF experts
    are transformers 5's fused gate_up_proj / down_proj tensors, as PEFT and SGLang read them."""
    lora_experts_interleaved: ClassVar[bool] = False
    """Whether its HF gate_up_proj holds the experts as [E, d, 2w] with gate and up columns interleaved
    (gate even, up odd; gpt-oss), not Qwen3-MoE's [E, 2w, d] of gate rows, then up rows: PEFT's B rows
    follow its layout, and the merge on disk writes its fused tensors (models/lora_experts.py)."""

    def lora_experts_unserved(self, spec: ModelSpec) -> str | None:
        """Why SGLang 0.5.23 serves none of `spec`'s routed-expert adapters (model.lora.sync=adapter is
        refused with that reason; sync=merged trains them); None: it serves them. Default: None."""
        return None


# -- answers shared by the families


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """Key/value heads one SGLang rank caches at TP `tp`: at least one (replicated beyond the heads)."""
    return max(1, spec.num_kv_heads // tp)


def hook_topk_routers(model: Any, record: Callable[[int, Any], None], router: type) -> tuple[int, ...]:
    """Family.hook_routes for a model whose routed layers' `mlp.gate` is a `router`, a transformers
    top-k router returning (logits, weights, indices) (Qwen3-MoE's, GLM-4.5's, DeepSeek-V3's)."""
    gates = [(i, getattr(getattr(layer, "mlp", None), "gate", None)) for i, layer in enumerate(model.model.layers)]
    routed = [(i, gate) for i, gate in gates if isinstance(gate, router)]
    for slot, (_, gate) in enumerate(routed):
        gate.register_forward_hook(partial(_record_indices, record, slot))
    return tuple(i for i, _ in routed)


def _record_indices(record: Callable[[int, Any], None], slot: int, module: Any, args: Any, output: tuple) -> None:
    record(slot, output[2])


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


def read_yarn(scaling: dict | None, family: str, truncates: bool = False) -> YarnSpec | None:
    """YaRN from config.json's rope_scaling (None: plain RoPE) for `family`; ConfigError naming what
    is not mapped. `truncates`: the family maps YaRN's `truncate` setting (gpt-oss's false), else
    only its default (true) is accepted."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ConfigError("rope_scaling.rope_type", kind, f"only YaRN (yarn) is mapped for {family}")
    unmapped = {"attention_factor": None, "partial_rotary_factor": 1.0} | ({} if truncates else {"truncate": True})
    for key, default in unmapped.items():
        if scaling.get(key, default) != default:
            said = "is not mapped (Megatron's YaRN has no such setting)"
            raise ConfigError(f"rope_scaling.{key}", scaling[key], said)
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ConfigError(f"rope_scaling.{key}", None, "missing from YaRN's rope_scaling")
    return YarnSpec(
        factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(scaling.get("mscale") or 0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0),
        truncate=bool(scaling.get("truncate", True)),
    )
