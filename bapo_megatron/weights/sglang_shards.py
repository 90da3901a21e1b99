"""HF tensors pre-split for an SGLang tensor-parallel size (its `--load-format sharded_state`).

SGLang 0.5.23's ShardedStateLoader reads, on TP rank r, the files
`model-rank-{r}-part-{p}.safetensors`, whose tensors are that rank's parameters under the
engine's own module names (checked against sglang/srt/model_loader/loader.py,
layers/linear.py and layers/vocab_parallel_embedding.py, models/qwen2.py and llama.py):

- `self_attn.qkv_proj`: [q; k; v] of rank r's heads. With fewer key/value heads than ranks,
  each rank holds one key/value head, head r // (tp / kv_heads) (the engine replicates).
- `mlp.gate_up_proj`: [gate; up] of rank r's rows.
- `o_proj`, `down_proj`: rank r's input columns. Norms whole on every rank (Qwen3's per-head
  `self_attn.q_norm` and `k_norm` too: SGLang's models/qwen3.py). Each rank's names and shapes are
  the family's (models/: sglang_layer_shapes, check_sglang_tp).
- `model.embed_tokens`, `lm_head`: the vocabulary padded with zero rows to a multiple of 64
  (64 x tp when that does not divide by tp), rank r's contiguous rows of it. Tied
  embeddings are stored once, as `lm_head.weight` (the loader keeps the smaller name of
  tensors that share storage).
"""

from __future__ import annotations

import torch

from bapo_megatron.common.safetensors_stream import TensorEntry
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec

VOCAB_PADDING = 64
PATTERN = "model-rank-{rank}-part-{part}.safetensors"


def check_sglang_tp(spec: ModelSpec, tp: int) -> None:
    """ValueError unless the model's family maps SGLang's pre-split layout at TP `tp`."""
    family_of(spec).check_sglang_tp(spec, tp)


def sglang_padded_vocab(vocab: int, tp: int) -> int:
    """The rows of SGLang's vocab-parallel embedding at TP `tp` (pad_vocab_size: a multiple of 64, of
    64 x tp when that does not divide by tp); not Megatron's (megatron_config.padded_vocab)."""
    pad = VOCAB_PADDING
    if (-(-vocab // pad) * pad) % tp:
        pad *= tp
    return -(-vocab // pad) * pad


def _kv_rows(spec: ModelSpec, tp: int, rank: int) -> slice:
    d = spec.head_dim
    if tp >= spec.num_kv_heads:
        head = rank // (tp // spec.num_kv_heads)
        return slice(head * d, (head + 1) * d)
    per = spec.num_kv_heads // tp * d
    return slice(rank * per, (rank + 1) * per)


def _rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank]


def _vocab_shard(weight: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    rows = sglang_padded_vocab(weight.shape[0], tp) // tp
    shard = weight.new_zeros(rows, *weight.shape[1:])
    part = weight[rank * rows : (rank + 1) * rows]
    shard[: part.shape[0]] = part
    return shard


def rank_tensors(spec: ModelSpec, hf: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s SGLang tensors made from one group of HF tensors (a layer, the embedding, ...)."""
    out = {}
    for name, t in hf.items():
        if name == "model.embed_tokens.weight":
            out["lm_head.weight" if spec.tie_embeddings else name] = _vocab_shard(t, tp, rank)
        elif name == "lm_head.weight":
            out[name] = _vocab_shard(t, tp, rank)
        elif name.endswith("norm.weight"):
            out[name] = t
        elif ".self_attn.q_proj." in name:
            kind = name.rsplit(".", 1)[1]
            prefix = name.split("q_proj.")[0]
            kv = _kv_rows(spec, tp, rank)
            out[f"{prefix}qkv_proj.{kind}"] = torch.cat(
                [_rows(t, tp, rank), hf[f"{prefix}k_proj.{kind}"][kv], hf[f"{prefix}v_proj.{kind}"][kv]]
            )
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue  # fused with q_proj / gate_proj
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = t.chunk(tp, dim=1)[rank]
        elif name.endswith("mlp.gate_proj.weight"):
            up = hf[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([_rows(t, tp, rank), _rows(up, tp, rank)])
        else:
            raise KeyError(f"{name}: no SGLang mapping")
    return out


def rank_entries(spec: ModelSpec, tp: int, dtype: torch.dtype) -> list[TensorEntry]:
    """The tensors (names, shapes) each rank's files hold, in loading order (the same on every rank)."""
    d, family = spec.hidden_size, family_of(spec)
    vocab = (sglang_padded_vocab(spec.vocab_size, tp) // tp, d)
    entries = [TensorEntry("lm_head.weight" if spec.tie_embeddings else "model.embed_tokens.weight", vocab, dtype)]
    for i in range(spec.num_layers):
        entries += [TensorEntry(name, shape, dtype) for name, shape in family.sglang_layer_shapes(spec, i, tp).items()]
    entries.append(TensorEntry("model.norm.weight", (d,), dtype))
    if not spec.tie_embeddings:
        entries.append(TensorEntry("lm_head.weight", vocab, dtype))
    return entries


def merge_ranks(spec: ModelSpec, ranks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """HF tensors from every rank's SGLang tensors (the inverse of rank_tensors; for checks and tools)."""
    tp = len(ranks)
    first = ranks[0]
    out = {}
    for name in first:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            whole = torch.cat([r[name] for r in ranks])[: spec.vocab_size]
            out["model.embed_tokens.weight" if spec.tie_embeddings else name] = whole
        elif name.endswith("norm.weight"):
            out[name] = first[name]
        elif ".qkv_proj." in name:
            prefix, kind = name.split("qkv_proj.")
            q_rows = spec.num_heads // tp * spec.head_dim
            kv_rows = (first[name].shape[0] - q_rows) // 2
            parts = [r[name].split([q_rows, kv_rows, kv_rows]) for r in ranks]
            step = max(1, tp // spec.num_kv_heads)  # ranks sharing one key/value head
            out[f"{prefix}q_proj.{kind}"] = torch.cat([p[0] for p in parts])
            out[f"{prefix}k_proj.{kind}"] = torch.cat([p[1] for p in parts[::step]])
            out[f"{prefix}v_proj.{kind}"] = torch.cat([p[2] for p in parts[::step]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.cat([r[name] for r in ranks], dim=1)
        elif name.endswith("gate_up_proj.weight"):
            halves = [r[name].chunk(2) for r in ranks]
            out[name.replace("gate_up_proj", "gate_proj")] = torch.cat([h[0] for h in halves])
            out[name.replace("gate_up_proj", "up_proj")] = torch.cat([h[1] for h in halves])
    return out
