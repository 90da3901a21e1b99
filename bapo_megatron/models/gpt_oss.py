"""gpt-oss (GptOssForCausalLM): grouped-query attention with biases on every projection, a learned sink
logit per head (`self_attn.sinks`), a sliding window in the layers layer_types names, YaRN RoPE
(truncate false: the correction range is not rounded); routed experts in every layer (models/moe.py):
a softmax over the top-k router logits, the router with a bias, each expert the clamped SwiGLU
gate * sigmoid(1.702 gate) * (up + 1) with biases on both projections.

HF `model.layers.L.` -> Megatron `decoder.layers.L.`: q/k/v weights and biases fuse into linear_qkv;
o_proj's weight and bias are linear_proj's; sinks are the core attention's `softmax_offset`
(softmax_type "learnable"); mlp.router.{weight,bias} are router.{weight,bias}. A layer's experts are
fused on disk, as in transformers and SGLang's loader: mlp.experts.gate_up_proj [E, hidden, 2 I] with
each expert's gate and up columns interleaved (gate even, up odd), gate_up_proj_bias [E, 2 I],
down_proj [E, I, hidden], down_proj_bias [E, hidden]; Megatron's expert E has linear_fc1 [gate; up]
rows ([2 I, hidden]) and linear_fc2 [hidden, I], each with its bias. Megatron's gpt-oss activation is
quick_gelu (sigmoid gain 1.702, fixed) with glu_linear_offset 1 and activation_func_clamp_value.

Megatron-Core 0.16.1 needs workarounds, applied from layer_spec to this family's layers only
(models/gpt_oss_layers.py): experts adding their fc2 bias out of place (Megatron's in-place add fails
at EP 1) and not summing its gradient over TP twice; on the local spec, sliding-window layers that
mask the packed row's samples apart too (Megatron's window replaces the mask it is given) and sink
logits marked as split over TP. Replaying routes, the router's own choice counts its bias
(trainer/routing.py).
Released checkpoints keep the experts in MXFP4 (quantization_config quant_method mxfp4): read
dequantized (exactly, in bfloat16) and exported in MXFP4 again (models/quantized.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from bapo_megatron.errors import ConfigError, check
from bapo_megatron.models.decoder import Decoder
from bapo_megatron.models.family import common_fields, common_hf, read_yarn, rope_parameters, rope_theta, tiny_fields
from bapo_megatron.models.features import MoESpec, SlidingWindowSpec, YarnSpec
from bapo_megatron.models.gpt_oss_layers import gpt_oss_config, gpt_oss_layer
from bapo_megatron.models.lora_targets import Layout, Target, attention_targets, decoder_layout
from bapo_megatron.models.moe import RoutedExperts
from bapo_megatron.models.recipes import Fused, Recipe, Rows, expert_names, grouped_experts
from bapo_megatron.models.spec import ModelSpec

ALPHA = 1.702
"""The clamped SwiGLU's sigmoid gain: Megatron's quick_gelu has it fixed."""
LAYER_TYPES = ("sliding_attention", "full_attention")
SINKS = "self_attention.core_attention.softmax_offset"
STORED_BIASES = ("mlp.experts.experts.linear_fc1.bias", "mlp.experts.experts.linear_fc2.bias")
"""A layer's expert biases as a dist checkpoint stores them, stacked over the global experts."""
SGLANG_PRE_SPLIT = (
    "SGLang's pre-split layout of gpt-oss (its fused experts and sinks) is not mapped; write a Hugging "
    "Face directory instead (no --sglang-tp): SGLang loads it at any TP and EP"
)


class GptOss(RoutedExperts, Decoder):
    name = "gpt_oss"
    architectures = ("GptOssForCausalLM",)
    dequantized = (
        "its MXFP4 releases are read; for another scheme use a bf16 copy (transformers: "
        "from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True)), then save_pretrained)"
    )
    local_attention_fused = False  # its sink logits and windows: Megatron's softmax (gpt_oss_layers.WindowedAttention)

    # -- config.json
    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        if "num_local_experts" not in hf and "num_experts" not in hf:
            raise ConfigError("num_local_experts", None, "missing from config.json (GptOssForCausalLM)")
        if "num_experts_per_tok" not in hf:
            raise ConfigError("num_experts_per_tok", None, "missing from config.json (GptOssForCausalLM)")
        if not hf.get("attention_bias", True):
            raise ConfigError("attention_bias", False, "gpt-oss without attention biases is not mapped")
        if float(hf.get("swiglu_alpha", ALPHA)) != ALPHA:
            raise ConfigError("swiglu_alpha", hf["swiglu_alpha"], f"Megatron's gpt-oss activation has {ALPHA}")
        unknown = sorted(set(hf.get("layer_types") or ()) - set(LAYER_TYPES))
        if unknown:
            raise ConfigError("layer_types", unknown, f"only {list(LAYER_TYPES)} are mapped")

    def fields(self, hf: dict) -> dict[str, Any]:
        """Layer types default to transformers' (sliding in even layers, full in odd ones)."""
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(layers)]
        check(len(types) == layers, "layer_types", types, f"must name each of the {layers} layers")
        windowed = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        size = hf.get("sliding_window", 128)
        scaling = rope_parameters(hf)
        plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
        plain["rope_theta"] = rope_theta(hf) if "rope_theta" in hf or scaling else 150000.0
        moe = MoESpec(
            num_experts=int(hf.get("num_local_experts", hf.get("num_experts"))),
            top_k=int(hf["num_experts_per_tok"]),
            ffn_hidden_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,  # a softmax over the top-k logits
            sparse_layers=tuple(range(layers)),
        )
        return {
            **common_fields(plain),
            "architecture": self.name,
            "qkv_bias": True,
            "qk_norm": False,
            "moe": moe,
            "sliding_window": SlidingWindowSpec(size=int(size), layers=windowed) if windowed and size else None,
            "attention_sinks": True,
            "yarn": read_yarn(scaling, "gpt-oss", truncates=True),
            "linear_bias": True,
            "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        }

    def to_hf(self, spec: ModelSpec) -> dict:
        moe, window = spec.moe, spec.sliding_window
        if moe.sparse_layers != tuple(range(spec.num_layers)) or spec.ffn_hidden_size != moe.ffn_hidden_size:
            raise ValueError(f"{self.name}: experts of the MLP's width in every layer only ({moe})")
        common = {k: v for k, v in common_hf(spec).items() if k != "rope_scaling"}
        config = {
            "architectures": list(self.architectures),
            "model_type": self.name,
            **common,
            "attention_bias": True,
            "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k,
            "swiglu_limit": spec.swiglu_limit,
            "layer_types": [
                LAYER_TYPES[0] if window is not None and window.is_windowed(i) else LAYER_TYPES[1]
                for i in range(spec.num_layers)
            ],
            "sliding_window": window.size if window is not None else None,
        }
        yarn = spec.yarn
        if yarn is None:  # explicitly: transformers' gpt-oss config defaults to YaRN
            return config | {"rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta}}
        scaling = {"rope_type": "yarn", **dataclasses.asdict(yarn)}
        for key in ("mscale", "mscale_all_dim"):
            if not scaling[key]:
                del scaling[key]
        return config | {"rope_scaling": scaling}

    def tiny(self) -> ModelSpec:
        """4 experts of width 32, top-2; a window of 4 positions in layers 0 and 2; YaRN (factor 4 over
        256 positions, unrounded); a clamp that bites (0.5) on random weights."""
        fields = tiny_fields(self.name) | {"ffn_hidden_size": 32, "max_position_embeddings": 1024}
        moe = MoESpec(num_experts=4, top_k=2, ffn_hidden_size=32, norm_topk_prob=True, sparse_layers=(0, 1, 2, 3))
        yarn = YarnSpec(factor=4.0, original_max_position_embeddings=256, truncate=False)
        window = SlidingWindowSpec(size=4, layers=(0, 2))
        return ModelSpec(**fields, qkv_bias=True, moe=moe, **_gpt_oss(window, yarn, limit=0.5))

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The dense task model's attention (biases, sinks, a window of 32 in layers 0 and 2, plain RoPE)
        with 8 experts of width 128, top-2, in every layer, gpt-oss's clamp (7)."""
        spec = super().task_model(vocab_size, max_positions)
        moe = MoESpec(num_experts=8, top_k=2, ffn_hidden_size=128, norm_topk_prob=True, sparse_layers=(0, 1, 2, 3))
        window = SlidingWindowSpec(size=32, layers=(0, 2))
        gpt_oss = _gpt_oss(window, None, limit=7.0)
        return dataclasses.replace(spec, ffn_hidden_size=128, qkv_bias=True, moe=moe, **gpt_oss)

    # -- HF tensors
    def _attention_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        p = f"model.layers.{layer}.self_attn."
        shapes = super()._attention_hf_shapes(spec, layer)
        return shapes | {p + "o_proj.bias": (spec.hidden_size,), p + "sinks": (spec.num_heads,)}

    def _mlp_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        e, d, width = spec.moe.num_experts, spec.hidden_size, spec.moe.ffn_hidden_size
        router, experts = _hf_mlp(layer)
        return {
            router + "weight": (e, d),
            router + "bias": (e,),
            experts + "gate_up_proj": (e, d, 2 * width),
            experts + "gate_up_proj_bias": (e, 2 * width),
            experts + "down_proj": (e, width, d),
            experts + "down_proj_bias": (e, d),
        }

    # -- HF <-> Megatron
    def _attention_recipes(self, spec: ModelSpec, layer: int) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}."
        recipes = super()._attention_recipes(spec, layer)
        recipes[m + "self_attention.linear_proj.bias"] = Rows((h + "o_proj.bias",))
        recipes[m + SINKS] = Rows((h + "sinks",))
        return recipes

    def _mlp_recipes(self, spec: ModelSpec, layer: int, grouped: bool) -> dict[str, Recipe]:
        m = f"decoder.layers.{layer}."
        router, experts = _hf_mlp(layer)
        recipes: dict[str, Recipe] = {
            m + "mlp.router.weight": Rows((router + "weight",)),
            m + "mlp.router.bias": Rows((router + "bias",)),
        }
        fused = (
            experts + "gate_up_proj",
            experts + "gate_up_proj_bias",
            experts + "down_proj",
            experts + "down_proj_bias",
        )
        makers = (_fc1_weight, _fc1_bias, _fc2_weight, _fc2_bias)
        for e in range(spec.moe.num_experts):
            for name, hf, make in zip(_expert_params(e, grouped), fused, makers, strict=True):
                recipes[m + name] = Fused(functools.partial(make, expert=e), (hf,))
        return recipes

    def _attention_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        h, m = f"model.layers.{layer}.self_attn.", f"decoder.layers.{layer}."
        yield from super()._attention_to_hf(spec, layer, mg)
        yield h + "o_proj.bias", mg[m + "self_attention.linear_proj.bias"]
        yield h + "sinks", mg[m + SINKS]

    def _mlp_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The router, then the layer's experts fused (each read by global index, in either naming, or
        a dist checkpoint's stacked biases)."""
        m = f"decoder.layers.{layer}."
        router, experts = _hf_mlp(layer)
        yield router + "weight", mg[m + "mlp.router.weight"]
        yield router + "bias", mg[m + "mlp.router.bias"]
        grouped = grouped_experts(mg)
        names = [_expert_params(e, grouped) for e in range(spec.moe.num_experts)]
        fc1 = torch.stack([_interleave(mg[m + n[0]].T, dim=1) for n in names])
        fc2 = torch.stack([mg[m + n[2]].T for n in names])
        if m + STORED_BIASES[0] in mg:
            fc1_bias, fc2_bias = mg[m + STORED_BIASES[0]], mg[m + STORED_BIASES[1]]
        else:
            fc1_bias = torch.stack([mg[m + n[1]] for n in names])
            fc2_bias = torch.stack([mg[m + n[3]] for n in names])
        yield experts + "gate_up_proj", fc1
        yield experts + "gate_up_proj_bias", _interleave(fc1_bias, dim=1)
        yield experts + "down_proj", fc2
        yield experts + "down_proj_bias", fc2_bias

    def _attention_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        shapes = super()._attention_stored_shapes(spec, layer)
        return shapes | {"self_attention.linear_proj.bias": (spec.hidden_size,), SINKS: (spec.num_heads,)}

    def _mlp_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        e, d, width = spec.moe.num_experts, spec.hidden_size, spec.moe.ffn_hidden_size
        shapes = super()._mlp_stored_shapes(spec, layer) | {"mlp.router.bias": (e,)}
        return shapes | {STORED_BIASES[0]: (e, 2 * width), STORED_BIASES[1]: (e, d)}

    def layer_params(self, spec: ModelSpec, layer: int) -> dict[str, int]:
        """The sinks split over TP with the heads; linear_proj's bias whole on every rank; the router's
        bias with the router; each expert's biases with it."""
        params = super().layer_params(spec, layer)
        e, d, width = spec.moe.num_experts, spec.hidden_size, spec.moe.ffn_hidden_size
        return params | {
            "tensor": params["tensor"] + spec.num_heads,
            "replicated": params["replicated"] + d,
            "router": params["router"] + e,
            "experts": params["experts"] + e * (2 * width + d),
        }

    # -- Megatron
    def config_class(self, spec: ModelSpec) -> type:
        return gpt_oss_config()

    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        window = spec.sliding_window
        fields = super().transformer_fields(spec) | {
            "add_bias_linear": spec.linear_bias,
            "activation_func": quick_gelu,
            "glu_linear_offset": 1.0,
            "activation_func_clamp_value": spec.swiglu_limit,
            "softmax_type": "learnable" if spec.attention_sinks else "vanilla",
        }
        if window is not None:  # Megatron's window is (positions before the query, after it)
            fields["window_size"] = (window.size - 1, 0)
            fields["window_attn_skip_freq"] = [int(window.is_windowed(i)) for i in range(spec.num_layers)]
        yarn = spec.yarn
        if yarn is None:
            return fields
        return fields | {
            "position_embedding_type": "yarn",
            "yarn_rotary_scaling_factor": yarn.factor,
            "yarn_original_max_position_embeddings": yarn.original_max_position_embeddings,
            "yarn_beta_fast": yarn.beta_fast,
            "yarn_beta_slow": yarn.beta_slow,
            # transformers scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when
            # both are set, else by mscale(factor); Megatron by the latter when either is None
            "yarn_mscale": yarn.mscale if yarn.mscale and yarn.mscale_all_dim else None,
            "yarn_mscale_all_dim": yarn.mscale_all_dim if yarn.mscale and yarn.mscale_all_dim else None,
            "yarn_correction_range_round_to_int": yarn.truncate,
        }

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """Megatron's MoE block spec with this family's experts (and, on the local spec, its core attention)."""
        block = super().layer_spec(spec, te, config, vp_stage)
        return dataclasses.replace(block, layer_specs=[gpt_oss_layer(layer, te) for layer in block.layer_specs])

    def packing_leak(self, spec: ModelSpec, te: bool) -> str | None:
        """None: the local spec's windows keep the packed row's mask (WindowedAttention), Transformer
        Engine's THD attention applies each window within a sample's cu_seqlens."""
        return None

    # -- LoRA
    lora_experts = True
    lora_experts_interleaved = True  # [E, d, 2w] / [E, w, d] (x @ W), gate and up columns interleaved

    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        """The attention's q/k/v/o (their biases and the sinks stay the base's)."""
        return attention_targets(spec, spec.num_heads * spec.head_dim)

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        return decoder_layout(spec, layer, module)

    # -- SGLang (models/gpt_oss.py)
    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        raise ValueError(SGLANG_PRE_SPLIT)

    def sglang_layer_shapes(self, spec: ModelSpec, layer: int, tp: int) -> dict[str, tuple[int, ...]]:
        raise ValueError(SGLANG_PRE_SPLIT)

    # -- the embedded engine
    def cache_by_position(self, spec: ModelSpec) -> bool:
        """transformers' cache of a sliding-window layer keeps its last window only."""
        return spec.sliding_window is None

    def hook_routes(self, model: Any, record: Callable[[int, Any], None]) -> tuple[int, ...]:
        """Every layer routes: its `mlp.router` returns (logits, weights, indices)."""
        for slot, layer in enumerate(model.model.layers):
            layer.mlp.router.register_forward_hook(functools.partial(_record_indices, record, slot))
        return tuple(range(len(model.model.layers)))


def _record_indices(record: Callable[[int, Any], None], slot: int, module: Any, args: Any, output: tuple) -> None:
    record(slot, output[2])


def _gpt_oss(window: SlidingWindowSpec | None, yarn: YarnSpec | None, limit: float) -> dict[str, Any]:
    """The ModelSpec fields every gpt-oss has, with its window, RoPE scaling and SwiGLU clamp."""
    return {"sliding_window": window, "attention_sinks": True, "yarn": yarn, "linear_bias": True, "swiglu_limit": limit}


# -- the experts' tensors


def _hf_mlp(layer: int) -> tuple[str, str]:
    """HF prefixes of layer `layer`'s router and (fused) experts."""
    p = f"model.layers.{layer}.mlp."
    return p + "router.", p + "experts."


def _expert_params(expert: int, grouped: bool) -> tuple[str, str, str, str]:
    """Megatron suffixes of expert `expert`'s fc1 weight and bias, fc2 weight and bias."""
    fc1, fc2 = expert_names(expert, grouped)
    if grouped:  # linear_fc1.weight{E} -> linear_fc1.bias{E}
        return fc1, fc1.replace(".weight", ".bias"), fc2, fc2.replace(".weight", ".bias")
    return fc1, fc1.removesuffix("weight") + "bias", fc2, fc2.removesuffix("weight") + "bias"


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up along `dim` (gate even, up odd) -> [gate; up]."""
    index = t.shape[dim]
    gate = t.index_select(dim, torch.arange(0, index, 2))
    up = t.index_select(dim, torch.arange(1, index, 2))
    return torch.cat([gate, up], dim=dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of _deinterleave: [gate; up] along `dim` -> gate even, up odd."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def _fc1_weight(gate_up: torch.Tensor, expert: int) -> torch.Tensor:
    return _deinterleave(gate_up[expert], dim=1).T.contiguous()


def _fc1_bias(bias: torch.Tensor, expert: int) -> torch.Tensor:
    return _deinterleave(bias[expert], dim=0)


def _fc2_weight(down: torch.Tensor, expert: int) -> torch.Tensor:
    return down[expert].T.contiguous()


def _fc2_bias(bias: torch.Tensor, expert: int) -> torch.Tensor:
    return bias[expert]
