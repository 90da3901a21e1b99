"""What a family's LoRA targets are: each adapted HF projection, the Megatron linear layer that computes
it and how that layer's TP rank lays its output out. The families answer with these (Family.lora_targets,
Family.lora_layout); models/lora.py turns them into names, counts and merges.

A column-parallel Megatron layer may fuse several HF projections (q/k/v into linear_qkv, gate/up into
linear_fc1, Qwen3.5's delta-rule projections into in_proj): its `Layout` says where each one's rows
are, so that each target keeps an adapter of its own that writes only its rows, as PEFT's does on the
HF model. Multi-latent attention's down-projections are neither: Megatron replicates them over TP
(models/mla.py), and their adapters whole on every rank ("replicated").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from bapo_megatron.models.spec import ModelSpec

QKV, PROJ = "self_attention.linear_qkv", "self_attention.linear_proj"
FC1, FC2 = "mlp.linear_fc1", "mlp.linear_fc2"
SHARED_FC1, SHARED_FC2 = "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"


@dataclass(frozen=True)
class Target:
    """One adapted HF projection of a layer, and where it lives in Megatron's layer."""

    name: str
    """The HF projection: "q_proj"."""
    hf_module: str
    """Its module within an HF layer: "self_attn.q_proj"."""
    module: str
    """The Megatron linear layer within a layer that computes it: "self_attention.linear_qkv"."""
    parallel: Literal["column", "row", "replicated"]
    """How Megatron splits the base layer over TP (and so the adapter: B rows, A columns, or neither)."""
    in_features: int
    out_features: int
    """The whole (TP = 1) projection's shape, as HF's weight [out, in]."""
    parts: tuple[int, ...] = ()
    """Where Megatron splits the projection's output part by part over TP (Qwen3.5's in_proj_qkv:
    query, key, value), the parts' whole widths: B is then whole on every rank, which takes its
    parts' rows (a TP rank's rows are no slice of B)."""
    served: bool = True
    """Whether SGLang 0.5.23 serves an adapter of it from PEFT's tensors (model.lora.sync=adapter);
    one it does not is trained with model.lora.sync=merged only."""
    served_with: tuple[str, ...] = ()
    """The targets SGLang serves it beside only, in one fused layer of its own (DeepSeek's q_a_proj and
    kv_a_proj_with_mqa: its fused_qkv_a_proj_with_mqa takes both adapters or neither)."""

    def split_dim(self, matrix: Literal["A", "B"]) -> int | None:
        """The dimension of lora_A / lora_B ([rank, in] / [out, rank]) split over TP; None: whole."""
        if self.parallel == "column":
            return 0 if matrix == "B" and not self.parts else None
        return 1 if matrix == "A" and self.parallel == "row" else None

    def params(self, rank: int, tp: int) -> int:
        """The adapter's parameters on one TP rank."""
        a, b = rank * self.in_features, self.out_features * rank
        if self.parallel == "row":
            return a // tp + b
        return a + (b if self.parts or self.parallel == "replicated" else b // tp)

    def served_beside(self, names: tuple[str, ...]) -> bool:
        """Whether SGLang serves its adapter when `names` are the adapted targets."""
        return self.served and all(name in names for name in self.served_with)


@dataclass(frozen=True)
class Slots:
    """How one TP rank's output of a fused column-parallel layer is laid out: `groups` repeats of the
    parts, each part `width` features wide (q/k/v: a query group's q heads, its k head, its v head)."""

    groups: int
    parts: tuple[tuple[str, int], ...]
    """(target name, width) in the order the fused output holds them."""
    paired: tuple[tuple[str, int], ...] = ()
    """(target name, head width) of the parts whose HF rows are heads each [a_h; b_h] and whose
    Megatron rows are every a_h, then every b_h (Qwen3.5's q_proj: queries and output gates)."""
    rope: tuple[tuple[str, int], ...] = ()
    """(target name, rotary width) of the parts whose last rows of each group are rotary dims that HF
    holds as two halves and Megatron interleaved (multi-latent attention with rope_interleave false:
    models/mla.interleave_rope)."""
    grouped: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """(target name, sizes) of the parts whose HF rows are groups each holding one share of several
    parts ([q_g; k_g; v_g; z_g] per key head: Qwen3-Next's in_proj_qkvz and in_proj_ba) and whose
    Megatron rows are every group's first share, then every group's second, ... (the groups are split
    over TP, so a rank's B rows are a slice of B)."""

    def reorder(self, y: torch.Tensor, name: str) -> torch.Tensor:
        """Target `name`'s output in HF's row order with each group's rotary rows and grouped shares in
        Megatron's order (unchanged where HF's is Megatron's)."""
        lead, rope, sizes = y.shape[:-1], dict(self.rope).get(name), dict(self.grouped).get(name)
        if sizes is not None:
            shares = y.reshape(*lead, -1, sum(sizes)).split(sizes, dim=-1)
            y = torch.cat([share.flatten(-2) for share in shares], dim=-1)
        if rope is None:
            return y
        groups = y.reshape(*lead, self.groups, -1)
        plain, rotary = groups.split([groups.shape[-1] - rope, rope], dim=-1)
        pairs = rotary.reshape(*lead, self.groups, 2, rope // 2).transpose(-1, -2)
        return torch.cat([plain, pairs.reshape(rotary.shape)], dim=-1).reshape(y.shape)


@dataclass(frozen=True)
class Layout:
    """A fused column-parallel layer's output as the whole (TP = 1) layer holds it; `split`: what TP
    divides, the groups (attention: query groups) or each part's width (MLP, delta-rule projections),
    or nothing (a replicated layer's)."""

    groups: int
    parts: tuple[tuple[str, int], ...]
    split: Literal["groups", "widths", "none"]
    paired: tuple[tuple[str, int], ...] = ()
    rope: tuple[tuple[str, int], ...] = ()
    grouped: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def rank(self, tp: int) -> Slots:
        """One TP rank's share."""
        orders = {"paired": self.paired, "rope": self.rope, "grouped": self.grouped}
        if self.split == "none":
            return Slots(self.groups, self.parts, **orders)
        if self.split == "groups":
            return Slots(self.groups // tp, self.parts, **orders)
        return Slots(self.groups, tuple((n, w // tp) for n, w in self.parts), **orders)


def attention_targets(spec: ModelSpec, q_width: int) -> dict[str, Target]:
    """Standard attention's q/k/v/o projections (q_width: q_proj's rows, doubled by an output gate)."""
    d, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {
        "q_proj": Target("q_proj", "self_attn.q_proj", QKV, "column", d, q_width),
        "k_proj": Target("k_proj", "self_attn.k_proj", QKV, "column", d, kv),
        "v_proj": Target("v_proj", "self_attn.v_proj", QKV, "column", d, kv),
        "o_proj": Target("o_proj", "self_attn.o_proj", PROJ, "row", q, d),
    }


def mlp_targets(spec: ModelSpec, layer: int, shared_hf: str) -> dict[str, Target]:
    """The gated MLP of a dense layer, or the shared expert of a routed one (`shared_hf`: its HF
    module under `mlp.`); none where a routed layer has no shared expert (its experts:
    model.lora.experts)."""
    d = spec.hidden_size
    if spec.moe is None or not spec.moe.is_sparse(layer):
        hf, fc1, fc2, width = "mlp.", FC1, FC2, spec.ffn_hidden_size
    elif spec.moe.shared_ffn_hidden_size:
        hf, fc1, fc2, width = f"mlp.{shared_hf}.", SHARED_FC1, SHARED_FC2, spec.moe.shared_ffn_hidden_size
    else:
        return {}
    return {
        "gate_proj": Target("gate_proj", hf + "gate_proj", fc1, "column", d, width),
        "up_proj": Target("up_proj", hf + "up_proj", fc1, "column", d, width),
        "down_proj": Target("down_proj", hf + "down_proj", fc2, "row", width, d),
    }


def decoder_targets(spec: ModelSpec, layer: int, shared_hf: str = "shared_expert") -> dict[str, Target]:
    """Every projection of a standard decoder layer LoRA adapts (Qwen2, Llama, Qwen3, Qwen3-MoE)."""
    return attention_targets(spec, spec.num_heads * spec.head_dim) | mlp_targets(spec, layer, shared_hf)


def decoder_layout(spec: ModelSpec, layer: int, module: str) -> Layout:
    """linear_qkv's per query group [its q heads; k; v], an MLP's fc1 [gate; up]."""
    if module == QKV:
        hd, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
        return Layout(spec.num_kv_heads, (("q_proj", per_group * hd), ("k_proj", hd), ("v_proj", hd)), "groups")
    width = mlp_targets(spec, layer, "")["gate_proj"].out_features
    assert module in (FC1, SHARED_FC1), module
    return Layout(1, (("gate_proj", width), ("up_proj", width)), "widths")
