"""The Qwen/Llama-style decoder every family here shares: RMSNorm, rotary GQA attention (q/k/v biases
and per-head q/k norms as the family says), a SiLU-gated MLP. Each layer-level answer is the
layer's two norms around an attention part (`_attention_*`) and an MLP part (`_mlp_*`): a family
with another attention in some layers (latent, linear, gated) overrides the `_attention_*` answers,
one with another MLP (experts) the `_mlp_*` answers, for the layers that have it.

HF names are those of checkpoints on disk and of SGLang's loader; Megatron's are those of its GPT
layer specs (local or Transformer Engine), whole tensors (TP = 1).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, ClassVar

import torch

from bapo_megatron.models.family import Family, common_fields
from bapo_megatron.models.recipes import Fused, Recipe, Rows, fuse_qkv, norm_names, split_qkv
from bapo_megatron.models.spec import ModelSpec

QKV = "self_attention.linear_qkv."


class Decoder(Family):
    """A dense decoder: attention then a gated MLP in every layer."""

    qkv_bias: ClassVar[bool] = False
    """q, k and v projections carry a bias (Qwen2): the spec's qkv_bias when read from config.json
    (the answers below read the spec, so a family may also take it from config.json)."""
    qk_norm: ClassVar[bool] = False
    """RMSNorm of each query and key head before RoPE (Qwen3): the spec's qk_norm, as qkv_bias."""

    def fields(self, hf: dict) -> dict[str, Any]:
        return {**common_fields(hf), "architecture": self.name, "qkv_bias": self.qkv_bias, "qk_norm": self.qk_norm}

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """Hidden 128 x 4 layers, 4 heads (2 KV) of 32, MLP 384, tied embeddings."""
        return ModelSpec(
            architecture=self.name,
            vocab_size=vocab_size,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=384,
            head_dim=32,
            max_position_embeddings=max_positions,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            tie_embeddings=True,
        )

    def routed(self, spec: ModelSpec, layer: int) -> bool:
        """Whether layer `layer` routes its tokens to experts (never, in a dense decoder)."""
        return False

    def norm_names(self, spec: ModelSpec, layer: int, impl: str) -> tuple[str, str]:
        return norm_names(impl, self.routed(spec, layer))

    # -- HF tensors
    def hf_layer_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        p, d = f"model.layers.{layer}.", spec.hidden_size
        shapes = {p + "input_layernorm.weight": (d,)} | self._attention_hf_shapes(spec, layer)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        return shapes | self._mlp_hf_shapes(spec, layer)

    def _attention_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        d, hd = spec.hidden_size, spec.head_dim
        kv, q = spec.num_kv_heads * hd, spec.num_heads * hd
        p = f"model.layers.{layer}."
        shapes = {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
        }
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,)})
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        return shapes

    def _mlp_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        p, d, width = f"model.layers.{layer}.mlp.", spec.hidden_size, spec.ffn_hidden_size
        return {
            p + "gate_proj.weight": (width, d),
            p + "up_proj.weight": (width, d),
            p + "down_proj.weight": (d, width),
        }

    # -- HF <-> Megatron
    def layer_recipes(self, spec: ModelSpec, layer: int, impl: str, grouped: bool) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn_norm, mlp_norm = self.norm_names(spec, layer, impl)
        recipes: dict[str, Recipe] = {m + attn_norm: Rows((h + "input_layernorm.weight",))}
        recipes |= self._attention_recipes(spec, layer)
        recipes[m + mlp_norm] = Rows((h + "post_attention_layernorm.weight",))
        return recipes | self._mlp_recipes(spec, layer, grouped)

    def _attention_recipes(self, spec: ModelSpec, layer: int) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        qkv = partial(fuse_qkv, spec=spec)
        recipes: dict[str, Recipe] = {
            m + QKV + "weight": Fused(qkv, tuple(h + f"self_attn.{n}_proj.weight" for n in "qkv")),
        }
        if spec.qkv_bias:
            recipes[m + QKV + "bias"] = Fused(qkv, tuple(h + f"self_attn.{n}_proj.bias" for n in "qkv"))
        if spec.qk_norm:
            recipes[m + "self_attention.q_layernorm.weight"] = Rows((h + "self_attn.q_norm.weight",))
            recipes[m + "self_attention.k_layernorm.weight"] = Rows((h + "self_attn.k_norm.weight",))
        recipes[m + "self_attention.linear_proj.weight"] = Rows((h + "self_attn.o_proj.weight",))
        return recipes

    def _mlp_recipes(self, spec: ModelSpec, layer: int, grouped: bool) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
        return {
            m + "linear_fc1.weight": Rows((h + "gate_proj.weight", h + "up_proj.weight")),
            m + "linear_fc2.weight": Rows((h + "down_proj.weight",)),
        }

    def layer_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor], impl: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn_norm, mlp_norm = self.norm_names(spec, layer, impl)
        yield h + "input_layernorm.weight", mg[m + attn_norm]
        yield from self._attention_to_hf(spec, layer, mg)
        yield h + "post_attention_layernorm.weight", mg[m + mlp_norm]
        yield from self._mlp_to_hf(spec, layer, mg)

    def _attention_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        q, k, v = split_qkv(mg[m + QKV + "weight"], spec)
        yield from ((h + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v), strict=True))
        if spec.qkv_bias:
            q, k, v = split_qkv(mg[m + QKV + "bias"], spec)
            yield from ((h + f"self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (q, k, v), strict=True))
        if spec.qk_norm:
            yield h + "self_attn.q_norm.weight", mg[m + "self_attention.q_layernorm.weight"]
            yield h + "self_attn.k_norm.weight", mg[m + "self_attention.k_layernorm.weight"]
        yield h + "self_attn.o_proj.weight", mg[m + "self_attention.linear_proj.weight"]

    def _mlp_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        h, m = f"model.layers.{layer}.mlp.", f"decoder.layers.{layer}.mlp."
        gate, up = mg[m + "linear_fc1.weight"].chunk(2)
        yield h + "gate_proj.weight", gate
        yield h + "up_proj.weight", up
        yield h + "down_proj.weight", mg[m + "linear_fc2.weight"]

    def stored_layer_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        d = spec.hidden_size
        shapes = {
            QKV + "layer_norm_weight": (d,),
            "mlp.linear_fc1.layer_norm_weight": (d,),  # a MoE layer's pre_mlp_layernorm is stored under it too
        }
        return shapes | self._attention_stored_shapes(spec, layer) | self._mlp_stored_shapes(spec, layer)

    def _attention_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        d, hd = spec.hidden_size, spec.head_dim
        qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * hd
        shapes = {QKV + "weight": (qkv_rows, d), "self_attention.linear_proj.weight": (d, spec.num_heads * hd)}
        if spec.qkv_bias:
            shapes[QKV + "bias"] = (qkv_rows,)
        if spec.qk_norm:
            shapes.update({"self_attention.q_layernorm.weight": (hd,), "self_attention.k_layernorm.weight": (hd,)})
        return shapes

    def _mlp_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        d, width = spec.hidden_size, spec.ffn_hidden_size
        return {"mlp.linear_fc1.weight": (2 * width, d), "mlp.linear_fc2.weight": (d, width)}

    # -- Megatron
    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        import torch.nn.functional as F

        return {
            "num_layers": spec.num_layers,
            "hidden_size": spec.hidden_size,
            "num_attention_heads": spec.num_heads,
            "num_query_groups": spec.num_kv_heads,
            "kv_channels": spec.head_dim,
            "ffn_hidden_size": spec.ffn_hidden_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": spec.rms_norm_eps,
            "gated_linear_unit": True,
            "activation_func": F.silu,
            "add_bias_linear": False,
            "add_qkv_bias": spec.qkv_bias,
            "qk_layernorm": spec.qk_norm,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        }

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        if te:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)

    def layer_params(self, spec: ModelSpec, layer: int) -> dict[str, int]:
        return self._mlp_params(spec, layer, self._attention_params(spec, layer))

    def _attention_params(self, spec: ModelSpec, layer: int) -> dict[str, int]:
        """The attention's parameters and the layer's two norms, by how they are held."""
        d, hd = spec.hidden_size, spec.head_dim
        qkv = (spec.num_heads + 2 * spec.num_kv_heads) * hd
        attention = d * qkv + (qkv if spec.qkv_bias else 0) + spec.num_heads * hd * d
        norms = 2 * d + (2 * hd if spec.qk_norm else 0)  # a q/k norm is one head_dim vector each
        return {"tensor": attention, "replicated": norms, "router": 0, "experts": 0}

    def _mlp_params(self, spec: ModelSpec, layer: int, attention: dict[str, int]) -> dict[str, int]:
        return attention | {"tensor": attention["tensor"] + 3 * spec.hidden_size * spec.ffn_hidden_size}

    def normed_qk_width(self, spec: ModelSpec) -> int:
        return (spec.num_heads + spec.num_kv_heads) * spec.head_dim if spec.qk_norm else 0

    # -- SGLang
    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        if tp < 1 or spec.num_heads % tp:
            raise ValueError(f"SGLang TP {tp} must divide the {spec.num_heads} attention heads")
        if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
            raise ValueError(f"SGLang TP {tp} and the {spec.num_kv_heads} key/value heads must divide one another")
        if spec.ffn_hidden_size % tp:
            raise ValueError(f"SGLang TP {tp} must divide the MLP size {spec.ffn_hidden_size}")

    def sglang_layer_shapes(self, spec: ModelSpec, layer: int, tp: int) -> dict[str, tuple[int, ...]]:
        d, p = spec.hidden_size, f"model.layers.{layer}."
        shapes = {p + "input_layernorm.weight": (d,)} | self._attention_sglang_shapes(spec, layer, tp)
        return shapes | {
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_up_proj.weight": (2 * spec.ffn_hidden_size // tp, d),
            p + "mlp.down_proj.weight": (d, spec.ffn_hidden_size // tp),
        }

    def _attention_sglang_shapes(self, spec: ModelSpec, layer: int, tp: int) -> dict[str, tuple[int, ...]]:
        d, hd, p = spec.hidden_size, spec.head_dim, f"model.layers.{layer}."
        qkv = (spec.num_heads // tp + 2 * max(1, spec.num_kv_heads // tp)) * hd
        shapes = {p + "self_attn.qkv_proj.weight": (qkv, d)}
        if spec.qkv_bias:
            shapes[p + "self_attn.qkv_proj.bias"] = (qkv,)
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        shapes[p + "self_attn.o_proj.weight"] = (d, spec.num_heads * hd // tp)
        return shapes
