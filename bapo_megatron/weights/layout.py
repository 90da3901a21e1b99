"""Hugging Face <-> Megatron-Core parameter names and layouts (Qwen2/Qwen2.5, Llama 3), full tensors.

Megatron fuses q, k and v into one `linear_qkv` whose rows are interleaved per query group:
for each key/value head g, the rows of its heads_per_group query heads, then its key head,
then its value head. The gated MLP's `linear_fc1` is [gate; up]. The embedding (and an
untied output layer) is padded to the Megatron vocabulary size on import and trimmed on
export. With Transformer Engine's layer spec the two RMSNorm weights live inside the
following linear layer (`layer_norm_weight`). Tensors here are whole (TP = 1); sharding
over tensor and pipeline parallel ranks is dist_checkpointing's job.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from bapo_megatron.trainer.model_spec import ModelSpec

EXTRA_STATE = "_extra_state"


def _norm_names(impl: str) -> tuple[str, str]:
    if impl == "transformer_engine":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """[q; k; v] in Megatron's per-query-group interleaving (weights [rows, hidden] or biases [rows]),
    written into `out` (contiguous, of the fused shape) when given."""
    groups, d = spec.num_kv_heads, spec.head_dim
    per_group = spec.num_heads // groups
    tail = q.shape[1:]
    parts = [q.reshape(groups, per_group * d, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
    if out is not None:
        torch.cat(parts, dim=1, out=out.view(groups, (per_group + 2) * d, *tail))
        return out
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


def hf_layer_to_megatron(spec: ModelSpec, i: int, hf: Mapping[str, torch.Tensor], impl: str = "local",
                         out: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron (name, tensor) pairs of decoder layer i, read from HF names in `hf`.

    out: Megatron tensors to fuse q/k/v and gate/up straight into (saves a copy); the pairs
    then hold those tensors, already written.
    """
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn_norm, mlp_norm = _norm_names(impl)
    into = (lambda name: out[name]) if out is not None else (lambda name: None)
    yield m + attn_norm, hf[h + "input_layernorm.weight"]
    name = m + "self_attention.linear_qkv.weight"
    yield name, fuse_qkv(hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                         hf[h + "self_attn.v_proj.weight"], spec, into(name))
    if spec.qkv_bias:
        name = m + "self_attention.linear_qkv.bias"
        yield name, fuse_qkv(hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"],
                             hf[h + "self_attn.v_proj.bias"], spec, into(name))
    yield m + "self_attention.linear_proj.weight", hf[h + "self_attn.o_proj.weight"]
    yield m + mlp_norm, hf[h + "post_attention_layernorm.weight"]
    name = m + "mlp.linear_fc1.weight"
    yield name, torch.cat([hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], out=into(name))
    yield m + "mlp.linear_fc2.weight", hf[h + "mlp.down_proj.weight"]


def megatron_layer_to_hf(spec: ModelSpec, i: int, mg: Mapping[str, torch.Tensor],
                         impl: str = "local") -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of decoder layer i, read from Megatron names in `mg`."""
    h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn_norm, mlp_norm = _norm_names(impl)
    yield h + "input_layernorm.weight", mg[m + attn_norm]
    q, k, v = split_qkv(mg[m + "self_attention.linear_qkv.weight"], spec)
    yield from ((h + f"self_attn.{n}_proj.weight", t) for n, t in zip("qkv", (q, k, v), strict=True))
    if spec.qkv_bias:
        q, k, v = split_qkv(mg[m + "self_attention.linear_qkv.bias"], spec)
        yield from ((h + f"self_attn.{n}_proj.bias", t) for n, t in zip("qkv", (q, k, v), strict=True))
    yield h + "self_attn.o_proj.weight", mg[m + "self_attention.linear_proj.weight"]
    yield h + "post_attention_layernorm.weight", mg[m + mlp_norm]
    gate, up = mg[m + "mlp.linear_fc1.weight"].chunk(2)
    yield h + "mlp.gate_proj.weight", gate
    yield h + "mlp.up_proj.weight", up
    yield h + "mlp.down_proj.weight", mg[m + "mlp.linear_fc2.weight"]


def iter_hf_to_megatron(spec: ModelSpec, hf: Mapping[str, torch.Tensor], padded_vocab: int, impl: str = "local",
                        out: Mapping[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron's TP=1 (name, tensor) pairs of a whole HF state dict, in loading order, made one at a
    time (reading `hf` lazily); `out` as in hf_layer_to_megatron."""
    yield "embedding.word_embeddings.weight", pad_vocab(hf["model.embed_tokens.weight"], padded_vocab)
    for i in range(spec.num_layers):
        yield from hf_layer_to_megatron(spec, i, hf, impl, out)
    yield "decoder.final_layernorm.weight", hf["model.norm.weight"]
    if not spec.tie_embeddings:
        yield "output_layer.weight", pad_vocab(hf["lm_head.weight"], padded_vocab)


def hf_to_megatron(spec: ModelSpec, hf: Mapping[str, torch.Tensor], padded_vocab: int,
                   impl: str = "local") -> dict[str, torch.Tensor]:
    """A whole HF state dict as Megatron's TP=1 state dict (names of `impl`'s layer spec)."""
    return dict(iter_hf_to_megatron(spec, hf, padded_vocab, impl))


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
