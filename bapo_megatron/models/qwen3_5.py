"""Qwen3.5 / Qwen3.6, dense (qwen3_5_text) and MoE (qwen3_5_moe_text), in the text layout
(Qwen3_5ForCausalLM) and the released multimodal one (Qwen3_5ForConditionalGeneration: its vision
tower and MTP layer carried, not trained): a hybrid of Gated DeltaNet linear attention (layer_types
"linear_attention", three of every four layers) and gated full attention (the fourth), Qwen3's MLP
or routed experts with a gated shared expert, every RMSNorm zero-centred ((1 + w)) but the delta
rule's gated one.

Full attention: q_proj holds each head's query and output gate ([q_h; g_h] per head); Megatron's
`attention_output_gate` fuses them into linear_qkv per query group as [q heads; gate heads; k; v];
q/k norms per head; RoPE on the first `partial_rotary_factor` of each head (Megatron's
rotary_percent). Linear attention: HF in_proj_qkv / in_proj_z / in_proj_b / in_proj_a are the parts
query, key, value, z, beta, alpha of Megatron's in_proj, conv1d's rows the parts query, key, value
(recipes.Parts: each part is split over TP on its own). Megatron's modules and their CPU obstacles
are models/gdn.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models.family import AttentionMemory, common_hf, tiny_fields
from bapo_megatron.models.features import LinearAttentionSpec
from bapo_megatron.models.lora_targets import Layout, Target, attention_targets, decoder_layout, mlp_targets
from bapo_megatron.models.on_disk import MULTIMODAL_LAYOUT, TEXT_LAYOUT, DiskLayout, KeptTensors
from bapo_megatron.models.qwen3 import Qwen3
from bapo_megatron.models.recipes import Fused, Parts, Recipe, Rows
from bapo_megatron.models.spec import ModelSpec

QKV = "self_attention.linear_qkv."
GDN = "self_attention."
LINEAR, FULL = "linear_attention", "full_attention"
DEFAULTS = {
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
"""Qwen3_5TextConfig's defaults for the keys a config.json may leave out (transformers reads them so)."""
IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")
"""The parts of Megatron's in_proj, in its rows' order (its checkpoints' `in_proj.weight.<part>`)."""


def fuse_gated_qkv(q_gate: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q_proj ([q_h; gate_h] per head), k_proj, v_proj as Megatron's gated linear_qkv: per query
    group, its heads' queries, their gates, its key, its value."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    qg = q_gate.reshape(groups, per_group, 2, d, q_gate.shape[-1])
    parts = [
        qg[:, :, 0].reshape(groups, per_group * d, -1),
        qg[:, :, 1].reshape(groups, per_group * d, -1),
        k.reshape(groups, d, -1),
        v.reshape(groups, d, -1),
    ]
    return torch.cat(parts, dim=1).reshape(-1, q_gate.shape[-1])


def split_gated_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_gated_qkv: HF q_proj, k_proj, v_proj."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    q, gate, k, v = qkv.reshape(groups, (2 * per_group + 2) * d, -1).split([per_group * d] * 2 + [d, d], dim=1)
    q_gate = torch.stack([q.reshape(groups, per_group, d, -1), gate.reshape(groups, per_group, d, -1)], dim=2)
    hidden = qkv.shape[-1]
    return q_gate.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _rows(start: int, stop: int, tensor: torch.Tensor) -> torch.Tensor:
    return tensor[start:stop]


def gdn_widths(spec: ModelSpec) -> tuple[int, int, int]:
    """The delta rule's query (= key) width, value (= z) width and value heads."""
    la = spec.linear_attention
    return la.num_key_heads * la.key_head_dim, la.num_value_heads * la.value_head_dim, la.num_value_heads


class Qwen3_5(Qwen3):
    """Qwen3.5 dense: Qwen3's decoder (q/k norms, no biases) with the hybrid attention above."""

    name = "qwen3_5_text"
    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")

    # -- checkpoints on disk
    def disk_layout(self, hf: dict) -> DiskLayout:
        """The released checkpoints' multimodal layout (text under model.language_model., config under
        text_config), or the text-only one."""
        return MULTIMODAL_LAYOUT if "text_config" in hf else TEXT_LAYOUT

    def kept_tensors(self, spec: ModelSpec, hf: dict) -> KeptTensors:
        """The vision tower (multimodal layout) and the multi-token-prediction layers (`mtp.*`, when
        mtp_num_hidden_layers says there are some), carried untouched: text RL trains neither."""
        text = self.disk_layout(hf).text_part(hf)
        mtp = ("mtp.",) if text.get("mtp_num_hidden_layers") else ()
        return KeptTensors((("model.visual.",) if "text_config" in hf else ()) + mtp)

    # -- config.json
    def refuse(self, hf: dict) -> None:
        super().refuse(hf)
        if hf.get("attn_output_gate", True) is not True:
            raise ConfigError("attn_output_gate", hf["attn_output_gate"], "only gated full attention is mapped")
        if hf.get("output_gate_type", "sigmoid") != "sigmoid":  # transformers 5.24 reads no other
            raise ConfigError("output_gate_type", hf["output_gate_type"], "only the sigmoid output gate is mapped")
        kinds = set(hf.get("layer_types") or ()) - {LINEAR, FULL}
        if kinds:
            raise ConfigError("layer_types", sorted(kinds), f"only {LINEAR!r} and {FULL!r} layers are mapped")

    def fields(self, hf: dict) -> dict[str, Any]:
        hf = {**DEFAULTS, **hf}
        layers = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or [
            LINEAR if (i + 1) % int(hf.get("full_attention_interval", 4)) else FULL for i in range(layers)
        ]
        if len(kinds) != layers:
            raise ConfigError("layer_types", kinds, f"must name each of the {layers} layers")
        linear = LinearAttentionSpec(
            layers=tuple(i for i, kind in enumerate(kinds) if kind == LINEAR),
            num_key_heads=int(hf["linear_num_key_heads"]),
            num_value_heads=int(hf["linear_num_value_heads"]),
            key_head_dim=int(hf["linear_key_head_dim"]),
            value_head_dim=int(hf["linear_value_head_dim"]),
            conv_kernel_dim=int(hf["linear_conv_kernel_dim"]),
        )
        rope = hf.get("rope_parameters") or {}
        fraction = float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25)))
        return {**super().fields(hf), "rotary_fraction": fraction, "linear_attention": linear}

    def to_hf(self, spec: ModelSpec) -> dict:
        la, common = spec.linear_attention, common_hf(spec)
        rope = {"rope_type": "default", "rope_theta": common.pop("rope_theta")}
        return {
            "architectures": [self.architectures[0]],  # the text layout's
            "model_type": self.name,
            "attention_bias": False,
            **common,
            "rope_parameters": {**rope, "partial_rotary_factor": spec.rotary_fraction},
            "layer_types": [LINEAR if la.is_linear(i) else FULL for i in range(spec.num_layers)],
            "linear_conv_kernel_dim": la.conv_kernel_dim,
            "linear_key_head_dim": la.key_head_dim,
            "linear_value_head_dim": la.value_head_dim,
            "linear_num_key_heads": la.num_key_heads,
            "linear_num_value_heads": la.num_value_heads,
        }

    def tiny(self) -> ModelSpec:
        """Three linear-attention layers, then one full; 2 key and 4 value heads of 16 (TP 2 splits them)."""
        linear = LinearAttentionSpec(
            layers=(0, 1, 2), num_key_heads=2, num_value_heads=4, key_head_dim=16, value_head_dim=16, conv_kernel_dim=4
        )
        base = {**tiny_fields(self.name), "qkv_bias": False, "qk_norm": True}
        return ModelSpec(**base, rotary_fraction=0.25, linear_attention=linear)

    def task_model(self, vocab_size: int, max_positions: int) -> ModelSpec:
        """The dense task model's shape, its first three layers linear attention (2 key, 4 value heads of 32)."""
        linear = LinearAttentionSpec(
            layers=(0, 1, 2), num_key_heads=2, num_value_heads=4, key_head_dim=32, value_head_dim=32, conv_kernel_dim=4
        )
        base = super().task_model(vocab_size, max_positions).as_dict()
        return ModelSpec(**{**base, "rotary_fraction": 0.25, "linear_attention": linear})

    def _linear(self, spec: ModelSpec, layer: int) -> bool:
        return spec.linear_attention.is_linear(layer)

    def norm_names(self, spec: ModelSpec, layer: int, impl: str) -> tuple[str, str]:
        """A linear-attention layer keeps its norms as modules of their own under either spec."""
        if self._linear(spec, layer):
            return "input_layernorm.weight", "pre_mlp_layernorm.weight"
        return super().norm_names(spec, layer, impl)

    # -- HF tensors
    def _attention_hf_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        d, hd = spec.hidden_size, spec.head_dim
        if not self._linear(spec, layer):
            shapes = super()._attention_hf_shapes(spec, layer)
            shapes[f"model.layers.{layer}.self_attn.q_proj.weight"] = (2 * spec.num_heads * hd, d)
            return shapes
        la, p = spec.linear_attention, f"model.layers.{layer}.linear_attn."
        qk, v, heads = gdn_widths(spec)
        return self._in_proj_hf_shapes(spec, p) | {
            p + "conv1d.weight": (2 * qk + v, 1, la.conv_kernel_dim),
            p + "dt_bias": (heads,),
            p + "A_log": (heads,),
            p + "norm.weight": (la.value_head_dim,),
            p + "out_proj.weight": (d, v),
        }

    # -- HF <-> Megatron
    def _attention_recipes(self, spec: ModelSpec, layer: int) -> dict[str, Recipe]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        if not self._linear(spec, layer):
            recipes = super()._attention_recipes(spec, layer)
            qkv = tuple(h + f"self_attn.{n}_proj.weight" for n in "qkv")
            return recipes | {m + QKV + "weight": Fused(partial(fuse_gated_qkv, spec=spec), qkv)}
        p, (qk, v, _) = h + "linear_attn.", gdn_widths(spec)
        bounds = {"query": (0, qk), "key": (qk, 2 * qk), "value": (2 * qk, 2 * qk + v)}

        def rows_of(name: str, part: str) -> Fused:
            return Fused(partial(_rows, *bounds[part]), (p + name,))

        return {
            m + GDN + "in_proj.weight": Parts(self._in_proj_parts(spec, p)),
            m + GDN + "conv1d.weight": Parts(tuple((part, rows_of("conv1d.weight", part)) for part in bounds)),
            m + GDN + "dt_bias": Rows((p + "dt_bias",)),
            m + GDN + "A_log": Rows((p + "A_log",)),
            m + GDN + "out_norm.weight": Rows((p + "norm.weight",)),
            m + GDN + "out_proj.weight": Rows((p + "out_proj.weight",)),
        }

    def _attention_to_hf(
        self, spec: ModelSpec, layer: int, mg: Mapping[str, torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        if not self._linear(spec, layer):
            q, k, v = split_gated_qkv(mg[m + QKV + "weight"], spec)
            yield from ((h + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v), strict=True))
            yield h + "self_attn.q_norm.weight", mg[m + "self_attention.q_layernorm.weight"]
            yield h + "self_attn.k_norm.weight", mg[m + "self_attention.k_layernorm.weight"]
            yield h + "self_attn.o_proj.weight", mg[m + "self_attention.linear_proj.weight"]
            return
        in_proj, conv = self._gdn_parts(spec, m, mg, "in_proj.weight"), self._gdn_parts(spec, m, mg, "conv1d.weight")
        p = h + "linear_attn."
        yield from self._in_proj_to_hf(spec, p, in_proj)
        yield p + "conv1d.weight", torch.cat(conv)
        for ours, theirs in (("dt_bias", "dt_bias"), ("A_log", "A_log"), ("out_norm.weight", "norm.weight")):
            yield p + theirs, mg[m + GDN + ours]
        yield p + "out_proj.weight", mg[m + GDN + "out_proj.weight"]

    # the delta rule's input projections: Qwen3.5's four HF tensors (Qwen3-Next groups them otherwise)
    def _in_proj_hf_shapes(self, spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
        d, (qk, v, heads) = spec.hidden_size, gdn_widths(spec)
        return {
            p + "in_proj_qkv.weight": (2 * qk + v, d),
            p + "in_proj_z.weight": (v, d),
            p + "in_proj_b.weight": (heads, d),
            p + "in_proj_a.weight": (heads, d),
        }

    def _in_proj_parts(self, spec: ModelSpec, p: str) -> tuple[tuple[str, Recipe], ...]:
        """Megatron's in_proj parts (IN_PROJ_PARTS) from the HF tensors."""
        qk, v, _ = gdn_widths(spec)
        qkv = [(0, qk), (qk, 2 * qk), (2 * qk, 2 * qk + v)]
        name = p + "in_proj_qkv.weight"
        parts = [(part, Fused(partial(_rows, *b), (name,))) for part, b in zip(IN_PROJ_PARTS[:3], qkv, strict=True)]
        rows = (Rows((p + f"in_proj_{n}.weight",)) for n in "zba")
        return (*parts, *zip(IN_PROJ_PARTS[3:], rows, strict=True))

    def _in_proj_to_hf(self, spec: ModelSpec, p: str, parts: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        yield p + "in_proj_qkv.weight", torch.cat(parts[:3])
        yield from ((p + f"in_proj_{n}.weight", t) for n, t in zip("zba", parts[3:], strict=True))

    def _gdn_parts(self, spec: ModelSpec, m: str, mg: Mapping[str, torch.Tensor], name: str) -> list[torch.Tensor]:
        """in_proj's or conv1d's parts (query, key, value[, z, beta, alpha]): split from the whole
        tensor, or read as a dist checkpoint stores them (one key each)."""
        qk, v, heads = gdn_widths(spec)
        sizes = [qk, qk, v, v, heads, heads][: 6 if name.startswith("in_proj") else 3]
        key = m + GDN + name
        if key in mg:
            return list(mg[key].split(sizes))
        return [mg[f"{key}.{part}"] for part in IN_PROJ_PARTS[: len(sizes)]]

    def stored_layer_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        if not self._linear(spec, layer):
            return super().stored_layer_shapes(spec, layer)
        d = spec.hidden_size
        shapes = {"input_layernorm.weight": (d,), "mlp.linear_fc1.layer_norm_weight": (d,)}
        return shapes | self._attention_stored_shapes(spec, layer) | self._mlp_stored_shapes(spec, layer)

    def _attention_stored_shapes(self, spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
        d, hd = spec.hidden_size, spec.head_dim
        if not self._linear(spec, layer):
            shapes = super()._attention_stored_shapes(spec, layer)
            return shapes | {QKV + "weight": ((2 * spec.num_heads + 2 * spec.num_kv_heads) * hd, d)}
        la = spec.linear_attention
        qk, v, heads = gdn_widths(spec)
        rows = dict(zip(IN_PROJ_PARTS, (qk, qk, v, v, heads, heads), strict=True))
        shapes = {f"{GDN}in_proj.weight.{part}": (n, d) for part, n in rows.items()}
        shapes |= {f"{GDN}conv1d.weight.{part}": (rows[part], 1, la.conv_kernel_dim) for part in IN_PROJ_PARTS[:3]}
        return shapes | {
            GDN + "dt_bias": (heads,),
            GDN + "A_log": (heads,),
            GDN + "out_norm.weight": (la.value_head_dim,),
            GDN + "out_proj.weight": (d, v),
        }

    def _attention_params(self, spec: ModelSpec, layer: int) -> dict[str, int]:
        d, hd = spec.hidden_size, spec.head_dim
        if not self._linear(spec, layer):
            counts = super()._attention_params(spec, layer)
            return counts | {"tensor": counts["tensor"] + spec.num_heads * hd * d}  # the output gate's rows
        la = spec.linear_attention
        qk, v, heads = gdn_widths(spec)
        tensor = d * (2 * qk + 2 * v + 2 * heads) + (2 * qk + v) * la.conv_kernel_dim + 2 * heads + v * d
        return {"tensor": tensor, "replicated": 2 * d + la.value_head_dim, "router": 0, "experts": 0}

    # -- Megatron
    def transformer_fields(self, spec: ModelSpec) -> dict[str, Any]:
        la = spec.linear_attention
        return super().transformer_fields(spec) | {
            "attention_output_gate": True,
            "layernorm_zero_centered_gamma": True,
            "experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": [int(la.is_linear(i)) for i in range(spec.num_layers)],
            "linear_conv_kernel_dim": la.conv_kernel_dim,
            "linear_key_head_dim": la.key_head_dim,
            "linear_value_head_dim": la.value_head_dim,
            "linear_num_key_heads": la.num_key_heads,
            "linear_num_value_heads": la.num_value_heads,
        }

    def layer_spec(self, spec: ModelSpec, te: bool, config: Any = None, vp_stage: int | None = None) -> Any:
        """A block spec built by hand (Megatron's hybrid builder is Transformer Engine's only): the
        local layer spec with zero-centred norms, its attention Gated DeltaNet in the linear layers."""
        self.check_impl(spec, te)
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from bapo_megatron.models.gdn import ZeroCenteredRMSNorm

        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        built = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
        experts = spec.moe.num_experts if spec.moe is not None else None
        layers = [_local_layer(self._linear(spec, i), experts if self.routed(spec, i) else None) for i in built]
        return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCenteredRMSNorm)

    def check_impl(self, spec: ModelSpec, te: bool) -> None:
        """The hand-built block spec has Megatron's local modules only."""
        if te:
            raise ConfigError(
                "model.transformer_impl",
                "transformer_engine",
                "Qwen3.5's hybrid layers are built with Megatron's local modules only (model.transformer_impl=local)",
            )

    def attention_memory(self, spec: ModelSpec, layer: int, local: bool, selective: bool) -> AttentionMemory:
        """Full attention's output gate keeps sigmoid(gate) (in fp32 under the local modules) and the
        gated context, linear_proj's input (Megatron's _apply_output_gate); a linear-attention layer
        keeps linear_attention_memory's and no scores."""
        if self._linear(spec, layer):
            return linear_attention_memory(spec)
        base, gate = super().attention_memory(spec, layer, local, selective), spec.num_heads * spec.head_dim
        if local:
            return dataclasses.replace(base, split=base.split + gate, fp32=base.fp32 + gate)
        return dataclasses.replace(base, split=base.split + 2 * gate)

    def engine_cache_bytes(self, spec: ModelSpec, tp: int, dtype_bytes: int = 2) -> int:
        """Keys and values of the full-attention layers only (a linear-attention layer caches no position)."""
        full = spec.num_layers - len(spec.linear_attention.layers)
        return super().engine_cache_bytes(spec, tp, dtype_bytes) * full // spec.num_layers

    def engine_state_bytes(self, spec: ModelSpec, tp: int) -> int:
        """Each linear-attention layer's state as SGLang 0.5.23 holds it (configs/qwen3_next.py
        mamba2_cache_params): the convolution's last kernel - 1 inputs of [q; k; v] in bf16, the delta
        rule's [value heads, value dim, key dim] in fp32 (mamba_ssm_dtype's default), split over TP."""
        la, (qk, v, heads) = spec.linear_attention, gdn_widths(spec)
        conv = (2 * qk + v) // tp * (la.conv_kernel_dim - 1) * 2
        state = heads // tp * la.value_head_dim * la.key_head_dim * 4
        return len(la.layers) * (conv + state)

    def packing_leak(self, spec: ModelSpec, te: bool) -> str | None:
        """Megatron 0.16.1's delta rule ignores the attention mask and refuses THD (packed_seq_params)."""
        return "Gated DeltaNet linear attention"

    def cache_by_position(self, spec: ModelSpec) -> bool:
        """The delta rule's recurrent and convolution states hold every position at once."""
        return False

    # -- LoRA
    def lora_targets(self, spec: ModelSpec, layer: int) -> dict[str, Target]:
        """Full attention's q/k/v/o (q_proj twice as wide: queries and output gates), or the delta
        rule's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a and out_proj; then the MLP (a routed
        layer's shared expert). SGLang 0.5.23 serves none of the four input projections from PEFT's
        tensors (its Qwen3.5 takes in_proj_q/k/v/z or a fused in_proj_qkvz, never in_proj_b/a):
        `served` False, trained with model.lora.sync=merged only."""
        mlp = mlp_targets(spec, layer, "shared_expert")  # Qwen3.5-MoE's HF name
        if not self._linear(spec, layer):
            return attention_targets(spec, 2 * spec.num_heads * spec.head_dim) | mlp
        d, (qk, v, heads) = spec.hidden_size, gdn_widths(spec)
        p, module = "linear_attn.", GDN + "in_proj"
        qkv = Target("in_proj_qkv", p + "in_proj_qkv", module, "column", d, 2 * qk + v, (qk, qk, v), served=False)
        inputs = {
            "in_proj_qkv": qkv,
            "in_proj_z": Target("in_proj_z", p + "in_proj_z", module, "column", d, v, served=False),
            "in_proj_b": Target("in_proj_b", p + "in_proj_b", module, "column", d, heads, served=False),
            "in_proj_a": Target("in_proj_a", p + "in_proj_a", module, "column", d, heads, served=False),
        }
        out = Target("out_proj", p + "out_proj", GDN + "out_proj", "row", v, d)
        return inputs | {"out_proj": out} | mlp

    def lora_layout(self, spec: ModelSpec, layer: int, module: str) -> Layout:
        """The gated linear_qkv: per query group its q heads and their gates (HF: each head's [q; gate]),
        its k and v heads; in_proj: [q; k; v], z, beta, alpha, each part split over TP."""
        if module == GDN + "in_proj":
            qk, v, heads = gdn_widths(spec)
            parts = (("in_proj_qkv", 2 * qk + v), ("in_proj_z", v), ("in_proj_b", heads), ("in_proj_a", heads))
            return Layout(1, parts, "widths")
        if module != QKV.rstrip("."):
            return decoder_layout(spec, layer, module)
        hd, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
        parts = (("q_proj", 2 * per_group * hd), ("k_proj", hd), ("v_proj", hd))
        return Layout(spec.num_kv_heads, parts, "groups", paired=(("q_proj", hd),))

    # -- SGLang
    def check_sglang_tp(self, spec: ModelSpec, tp: int) -> None:
        raise ValueError(
            "SGLang's pre-split layout of a Qwen3.5 hybrid (its merged linear-attention projections) is not "
            "mapped; write a Hugging Face directory instead (no --sglang-tp): SGLang loads it at any TP"
        )

    def sglang_layer_shapes(self, spec: ModelSpec, layer: int, tp: int) -> dict[str, tuple[int, ...]]:
        self.check_sglang_tp(spec, tp)
        return {}


def linear_attention_memory(spec: ModelSpec, chunk: int = 64) -> AttentionMemory:
    """What a Gated DeltaNet layer keeps for backward per token, op by op in Megatron-Core 0.16.1's
    GatedDeltaNet.forward: [q; k; v] thrice (convolution input, SiLU input and output), q and k copied
    and l2-normalised (4 qk), each repeated to the value heads, the value copied, z, the rule's output
    (5 v), the gated norm and the gates in fp32 (12 v, 8 a value head); and in fp32, per value head,
    what the torch delta rule (models/gdn.py's fallback without fla) keeps in chunks of 64: its
    in-chunk solve's clones ((chunk^2 - 1) / 3 a token), four [chunk, chunk] tensors, k and v twice."""
    (qk, v, heads), la = gdn_widths(spec), spec.linear_attention
    rule = heads * ((chunk * chunk - 1) // 3 + 4 * chunk + 2 * (la.key_head_dim + la.value_head_dim))
    return AttentionMemory(split=3 * (2 * qk + v) + 4 * qk + 5 * v + 12 * v + 8 * heads, fp32=rule, scores=False)


def _local_layer(linear: bool, experts: int | None) -> Any:
    """Megatron's local layer spec (its MLP the experts when `experts`) with zero-centred norms, its
    attention Gated DeltaNet when `linear` (that layer's input norm stored under its own name)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from bapo_megatron.models.gdn import ZeroCenteredRMSNorm, gated_delta_net_spec

    local = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm", qk_layernorm=True)
    layer = copy.deepcopy(local)
    parts, attention = layer.submodules, layer.submodules.self_attention.submodules
    parts.input_layernorm = parts.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
    if linear:
        parts.self_attention = gated_delta_net_spec()
        parts.sharded_state_dict_keys_map = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return layer
