"""Live export of a running TP x PP x EP Megatron model to HF names, in buckets, layer by layer.

Every rank of a pipeline stage runs the generator (the tensor- and expert-parallel gathers are
collectives) and gets the same buckets: the stage's HF tensors, in the order the receiver
can load them (embedding, layers in order, final norm and output layer), each exactly once
per stage, a MoE layer's experts one tensor per expert under global expert numbers. The caller
decides which rank sends them (e.g. tensor- and data-parallel rank 0 of every stage). Memory
beyond the model: one layer's gathered tensors plus one bucket.

A LoRA model is exported as one of three `Part`s: "model", the adapters merged into their base
weights after the gathers (models/lora.py merge_adapters), what an engine without LoRA serves;
"base", the base weights alone, adapters left out; "adapters", the adapters alone, gathered whole
under PEFT's names (models/lora.py peft_name), the base not touched (weights/lora_sync.py sends them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import torch
import torch.distributed as dist

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.lora import adapter_names, is_adapter, merge_adapters
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.dist_ckpt import unwrap
from bapo_megatron.trainer.lora import lora_scaling
from bapo_megatron.trainer.parallel import ParallelInfo
from bapo_megatron.weights.hf_load import expert_parts
from bapo_megatron.weights.layout import layer_impl, megatron_layer_to_hf

Bucket = list[tuple[str, torch.Tensor]]
Part = Literal["model", "base", "adapters"]


def gather_tensor_parallel(param: torch.Tensor, info: ParallelInfo, gated: bool = False) -> torch.Tensor:
    """The whole tensor of a (possibly) tensor-parallel parameter, on every TP rank.

    gated: the parameter is a gated fc1 whose shards are each [gate_i; up_i]; the whole
    tensor is [gate; up]. A parameter Megatron shards part by part (Gated DeltaNet's in_proj and
    conv1d) names its parts' sizes in each shard (`tp_parts`); the whole tensor is each part whole.
    """
    if info.tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    dim = param.partition_dim
    shards = [torch.empty_like(param) for _ in range(info.tp_size)]
    dist.all_gather(shards, param.detach().contiguous(), group=info.tp_group)
    parts = getattr(param, "tp_parts", None) or ((param.shape[dim] // 2,) * 2 if gated else None)
    if parts:
        pieces = [s.split(parts, dim=dim) for s in shards]
        return torch.cat([p[i] for i in range(len(parts)) for p in pieces], dim=dim)
    return torch.cat(shards, dim=dim)


def gather_expert_parallel(layer: torch.nn.Module, local: dict[str, torch.Tensor], info: ParallelInfo) -> dict:
    """A MoE layer's expert tensors of every expert-parallel rank, by global expert name (`local`:
    this rank's, by local name). Each rank holds the same number of experts, rank r experts
    [r * n, (r + 1) * n); an expert is never tensor-parallel (expert TP = 1)."""
    out = {}
    n = len(layer.mlp.local_expert_indices)
    assert layer.mlp.local_expert_indices[0] == info.ep_rank * n, "experts are not laid out by EP rank"
    for name, tensor in local.items():
        parts = expert_parts(name)
        if parts is None:
            out[name] = tensor
            continue
        head, index, tail = parts
        shards = [tensor]
        if info.ep_size > 1:
            shards = [torch.empty_like(tensor) for _ in range(info.ep_size)]
            dist.all_gather(shards, tensor.contiguous(), group=info.ep_group)
        for rank, shard in enumerate(shards):
            out[f"{head}{rank * n + index}{tail}"] = shard
    return out


def _layer_tensors(layer: torch.nn.Module, info: ParallelInfo, adapters: bool = True) -> dict[str, torch.Tensor]:
    """The layer's tensors gathered whole (experts by global number); adapters: LoRA's too."""
    local = {
        name: p.detach()
        if _is_expert(name)
        else gather_tensor_parallel(p, info, gated=name.endswith("linear_fc1.weight"))  # a shared expert's too
        for name, p in [*layer.named_parameters(), *_saved_buffers(layer)]
        if adapters or not is_adapter(name)
    }
    return gather_expert_parallel(layer, local, info) if hasattr(layer.mlp, "local_expert_indices") else local


def _layer_adapters(layer: torch.nn.Module, info: ParallelInfo) -> dict[str, torch.Tensor]:
    """The layer's adapters, each gathered whole; a routed expert's (model.lora.experts, whole on its
    rank: expert TP 1) gathered over expert parallel under its global number."""
    local = {
        name: p.detach() if _is_expert(name) else gather_tensor_parallel(p, info)
        for name, p in layer.named_parameters()
        if is_adapter(name)
    }
    return gather_expert_parallel(layer, local, info) if hasattr(layer.mlp, "local_expert_indices") else local


def peft_names(spec: ModelSpec) -> dict[str, str]:
    """Megatron's name -> PEFT's of every adapter matrix a LoRA model of `spec` can hold (names do not
    depend on the rank: the map of an all-linear config covers every config's adapters)."""
    every = LoRAConfig(rank=1, sync="merged", experts=spec.moe is not None)  # every target, served or not
    return adapter_names(spec, every)


def _saved_buffers(layer: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The layer's buffers that its state dict saves: a router's expert bias (Megatron keeps it out of
    the parameters: it has no gradient)."""
    saved = layer.state_dict(keep_vars=True)
    return [(name, b.detach()) for name, b in layer.named_buffers() if name in saved]


def _is_expert(name: str) -> bool:
    return name.startswith("mlp.experts.")


def _stage_tensors(
    chunk: torch.nn.Module, spec: ModelSpec, info: ParallelInfo, impl: str | None, part: Part = "model"
) -> Iterator[tuple[str, torch.Tensor]]:
    model = unwrap(chunk)
    if part == "adapters":
        yield from _stage_adapters(model, spec, info)
        return
    if model.pre_process:
        embedding = gather_tensor_parallel(model.embedding.word_embeddings.weight, info)
        yield "model.embed_tokens.weight", embedding[: spec.vocab_size]
    for layer in model.decoder.layers:
        index = layer.layer_number - 1  # global, 1-based in Megatron
        tensors = _layer_tensors(layer, info, adapters=part == "model")
        local = {f"decoder.layers.{index}.{name}": t for name, t in tensors.items()}
        if part == "model" and (scaling := lora_scaling(layer)) is not None:  # an engine without LoRA: merged
            local = merge_adapters(spec, local, scaling)
        yield from megatron_layer_to_hf(spec, index, local, impl or layer_impl(local))
    if model.post_process:
        yield "model.norm.weight", model.decoder.final_layernorm.weight.detach()
        if not spec.tie_embeddings:
            output = gather_tensor_parallel(model.output_layer.weight, info)
            yield "lm_head.weight", output[: spec.vocab_size]


def _stage_adapters(model: torch.nn.Module, spec: ModelSpec, info: ParallelInfo) -> Iterator[tuple[str, torch.Tensor]]:
    names = peft_names(spec)
    for layer in model.decoder.layers:
        index = layer.layer_number - 1
        for name, tensor in _layer_adapters(layer, info).items():
            yield names[f"decoder.layers.{index}.{name}"], tensor


def stream_hf_buckets(
    model_chunks: list[torch.nn.Module],
    spec: ModelSpec,
    info: ParallelInfo,
    bucket_bytes: int = 512 << 20,
    impl: str | None = None,
    dtype: torch.dtype | None = None,
    part: Part = "model",
) -> Iterator[Bucket]:
    """This stage's HF (name, tensor) pairs, grouped into buckets of at most bucket_bytes (see `buckets`);
    impl: the layer spec ("transformer_engine" or "local"; None: read from each layer's parameters);
    part: what of a LoRA model (the module says)."""
    named = (pair for chunk in model_chunks for pair in _stage_tensors(chunk, spec, info, impl, part))
    return buckets(named, bucket_bytes, dtype)


def buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = 512 << 20, dtype: torch.dtype | None = None
) -> Iterator[Bucket]:
    """(name, tensor) pairs, cast to `dtype` when given and made contiguous, grouped in order into
    buckets of at most bucket_bytes. A tensor larger than bucket_bytes travels alone in its own bucket."""
    bucket: Bucket = []
    size = 0
    for name, tensor in named:
        if dtype is not None:
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.contiguous()))
        size += nbytes
    if bucket:
        yield bucket
