"""Hugging Face <-> Megatron-Core parameter names and layouts (Qwen2/Qwen2.5, Llama 3, Qwen3,
Qwen3-MoE), full tensors.

Megatron fuses q, k and v into one `linear_qkv` whose rows are interleaved per query group:
for each key/value head g, the rows of its heads_per_group query heads, then its key head,
then its value head. The gated MLP's `linear_fc1` is [gate; up]. The embedding (and an
untied output layer) is padded to the Megatron vocabulary size on import and trimmed on
export. With Transformer Engine's layer spec the two RMSNorm weights live inside the
following linear layer (`layer_norm_weight`), except before a MoE layer's experts, whose norm
is a module of its own (`pre_mlp_layernorm`) under either spec. Qwen3's per-head q/k norms are
`self_attention.q_layernorm`/`k_layernorm`. A MoE layer's router is HF's `mlp.gate`; expert E's
gate and up projections stack into its `linear_fc1`, its down projection is its `linear_fc2`, named
`mlp.experts.local_experts.E.` one expert after another (SequentialMLP) or `mlp.experts.linear_fc1.weightE`
in Transformer Engine's grouped GEMM. HF names are those of checkpoints on disk and of SGLang's
loader (one tensor per expert), not transformers' in-memory fusion. Tensors here are whole (TP = 1,
EP = 1, E a global expert index); sharding over tensor, pipeline and expert parallel ranks is
dist_checkpointing's job, and the live export gathers them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from bapo_megatron.common.model_spec import ModelSpec


def _norm_names(impl: str, moe_layer: bool = False) -> tuple[str, str]:
    if impl == "transformer_engine":
        mlp = "pre_mlp_layernorm.weight" if moe_layer else "mlp.linear_fc1.layer_norm_weight"
        return "self_attention.linear_qkv.layer_norm_weight", mlp
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def expert_names(expert: int, grouped: bool) -> tuple[str, str]:
    """The Megatron suffixes (within a layer) of expert `expert`'s fc1 and fc2 weights."""
    if grouped:
        return f"mlp.experts.linear_fc1.weight{expert}", f"mlp.experts.linear_fc2.weight{expert}"
    base = f"mlp.experts.local_experts.{expert}."
    return base + "linear_fc1.weight", base + "linear_fc2.weight"


def hf_expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of expert `expert`'s gate, up and down projections in layer `layer`."""
    base = f"model.layers.{layer}.mlp.experts.{expert}."
    return base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"


_GROUPED = re.compile(r"mlp\.experts\.linear_fc[12]\.weight\d+$")


def grouped_experts(names: Iterable[str]) -> bool:
    """Whether a model's experts are Transformer Engine's grouped GEMM (from its parameter names)."""
    return any(_GROUPED.search(n) for n in names)


def layer_impl(names: Iterable[str]) -> str:
    """Which layer spec made a decoder layer, from its parameter names: Transformer Engine fuses
    the norms into linear_qkv and linear_fc1, the local spec keeps them as modules of their own."""
    names = list(names)
    for impl in ("transformer_engine", "local"):
        if any(n.endswith(_norm_names(impl)[0]) for n in names):
            return impl
    raise ValueError(f"a decoder layer with neither spec's input norm: {names[:4]}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[q; k; v] in Megatron's per-query-group interleaving (weights [rows, hidden] or biases [rows])."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    tail = q.shape[1:]
    parts = [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
    return torch.cat(parts, dim=1).reshape(groups * (per_group + 2) * d, *tail)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of fuse_qkv."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *tail).split([per_group * d, d, d], dim=1)
    return (q.reshape(spec.num_heads * d, *tail), k.reshape(groups * d, *tail), v.reshape(groups * d, *tail))


def pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] > padded:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows does not fit the padded size {padded}")
    return torch.cat([weight, weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])])


def megatron_layer_to_hf(
    spec: ModelSpec, i: int, mg: Mapping[str, torch.Tensor], impl: str = "local"
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of decoder layer i, read from Megatron names in `mg` (experts by
    global index, in either naming)."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    moe_layer = spec.is_moe_layer(i)
    attn_norm, mlp_norm = _norm_names(impl, moe_layer)
    yield h + "input_layernorm.weight", mg[m + attn_norm]
    q, k, v = split_qkv(mg[m + "self_attention.linear_qkv.weight"], spec)
    yield from ((h + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v), strict=True))
    if spec.qkv_bias:
        q, k, v = split_qkv(mg[m + "self_attention.linear_qkv.bias"], spec)
        yield from ((h + f"self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (q, k, v), strict=True))
    if spec.qk_norm:
        yield h + "self_attn.q_norm.weight", mg[m + "self_attention.q_layernorm.weight"]
        yield h + "self_attn.k_norm.weight", mg[m + "self_attention.k_layernorm.weight"]
    yield h + "self_attn.o_proj.weight", mg[m + "self_attention.linear_proj.weight"]
    yield h + "post_attention_layernorm.weight", mg[m + mlp_norm]
    if moe_layer:
        yield h + "mlp.gate.weight", mg[m + "mlp.router.weight"]
        grouped = grouped_experts(mg)
        for expert in range(spec.moe.num_experts):
            fc1, fc2 = expert_names(expert, grouped)
            gate_name, up_name, down_name = hf_expert_names(i, expert)
            gate, up = mg[m + fc1].chunk(2)
            yield gate_name, gate
            yield up_name, up
            yield down_name, mg[m + fc2]
        return
    gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2)
    yield h + "mlp.gate_proj.weight", gate
    yield h + "mlp.up_proj.weight", up
    yield h + "mlp.down_proj.weight", mg[m + "mlp.linear_fc2.weight"]


@dataclass(frozen=True)
class Rows:
    """A Megatron tensor made of HF tensors stacked by rows (one HF tensor: itself)."""

    names: tuple[str, ...]

    def __call__(self, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if len(self.names) == 1:
            return hf[self.names[0]]
        return torch.cat([hf[name] for name in self.names])

    def block(self, hf: Mapping[str, torch.Tensor], start: int, rows: int) -> torch.Tensor | None:
        """The HF tensor that is exactly rows [start, start + rows), when one is (no copy)."""
        at = 0
        for name in self.names:
            tensor = hf[name]
            if at == start and tensor.shape[0] == rows:
                return tensor
            at += tensor.shape[0]
        return None


@dataclass(frozen=True)
class Fused:
    """A Megatron tensor computed from several HF tensors (q/k/v interleaving, vocabulary padding)."""

    fn: Callable[..., torch.Tensor]
    names: tuple[str, ...]

    def __call__(self, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.fn(*(hf[name] for name in self.names))


Recipe = Rows | Fused


def recipe_region(
    recipe: Recipe,
    hf: Mapping[str, torch.Tensor],
    start: tuple[int, ...],
    shape: tuple[int, ...],
    whole: tuple[int, ...],
) -> torch.Tensor:
    """The region [start, start + shape) of the TP=1 tensor (of shape `whole`) that `recipe` makes:
    the tensor itself, the HF tensor that is exactly those rows (no copy), or a slice."""
    if tuple(shape) == tuple(whole):
        return recipe(hf)
    if isinstance(recipe, Rows) and not any(start[1:]) and tuple(shape[1:]) == tuple(whole[1:]):
        block = recipe.block(hf, start[0], shape[0])
        if block is not None:
            return block
    return recipe(hf)[tuple(slice(o, o + n) for o, n in zip(start, shape, strict=True))]


def megatron_recipes(
    spec: ModelSpec, padded_vocab: int, impl: str = "local", grouped: bool = False
) -> dict[str, Recipe]:
    """Every Megatron TP=1, EP=1 parameter name (names of `impl`'s layer spec; experts grouped or
    one after another), in loading order, with the recipe that makes it from a HF state dict,
    reading only the HF tensors it needs."""
    pad = partial(pad_vocab, padded=padded_vocab)
    qkv = partial(fuse_qkv, spec=spec)
    recipes: dict[str, Recipe] = {"embedding.word_embeddings.weight": Fused(pad, ("model.embed_tokens.weight",))}
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_names(impl, spec.is_moe_layer(i))
        recipes[m + attn_norm] = Rows((h + "input_layernorm.weight",))
        recipes[m + "self_attention.linear_qkv.weight"] = Fused(
            qkv, tuple(h + f"self_attn.{n}_proj.weight" for n in "qkv")
        )
        if spec.qkv_bias:
            recipes[m + "self_attention.linear_qkv.bias"] = Fused(
                qkv, tuple(h + f"self_attn.{n}_proj.bias" for n in "qkv")
            )
        if spec.qk_norm:
            recipes[m + "self_attention.q_layernorm.weight"] = Rows((h + "self_attn.q_norm.weight",))
            recipes[m + "self_attention.k_layernorm.weight"] = Rows((h + "self_attn.k_norm.weight",))
        recipes[m + "self_attention.linear_proj.weight"] = Rows((h + "self_attn.o_proj.weight",))
        recipes[m + mlp_norm] = Rows((h + "post_attention_layernorm.weight",))
        if spec.is_moe_layer(i):
            recipes[m + "mlp.router.weight"] = Rows((h + "mlp.gate.weight",))
            for expert in range(spec.moe.num_experts):
                fc1, fc2 = expert_names(expert, grouped)
                gate, up, down = hf_expert_names(i, expert)
                recipes[m + fc1] = Rows((gate, up))
                recipes[m + fc2] = Rows((down,))
            continue
        recipes[m + "mlp.linear_fc1.weight"] = Rows((h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"))
        recipes[m + "mlp.linear_fc2.weight"] = Rows((h + "mlp.down_proj.weight",))
    recipes["decoder.final_layernorm.weight"] = Rows(("model.norm.weight",))
    if not spec.tie_embeddings:
        recipes["output_layer.weight"] = Fused(pad, ("lm_head.weight",))
    return recipes


def hf_to_megatron(
    spec: ModelSpec, hf: Mapping[str, torch.Tensor], padded_vocab: int, impl: str = "local"
) -> dict[str, torch.Tensor]:
    """A whole HF state dict as Megatron's TP=1 state dict (names of `impl`'s layer spec)."""
    return {name: recipe(hf) for name, recipe in megatron_recipes(spec, padded_vocab, impl).items()}


def megatron_to_hf(spec: ModelSpec, mg: Mapping[str, torch.Tensor], impl: str = "local") -> dict[str, torch.Tensor]:
    """A whole Megatron TP=1 state dict as HF names and shapes, vocabulary padding trimmed."""
    vocab = spec.vocab_size
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:vocab]}
    for i in range(spec.num_layers):
        out.update(megatron_layer_to_hf(spec, i, mg, impl))
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][:vocab]
    return out
