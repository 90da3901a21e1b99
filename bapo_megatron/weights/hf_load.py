"""Hugging Face safetensors straight into a live Megatron model, at any TP / PP / VPP.

Each rank fills exactly its own slices: Megatron's sharded_state_dict says, for every local
parameter (and for each half of the gated fc1, through its factory), which rows and columns of
the whole TP=1 tensor it holds; the layout maps (weights/layout.py) make that whole tensor from
the memory-mapped HF files, one tensor at a time, and the rank copies its slice. Memory: about
one (TP=1) tensor beyond the model. Every parameter of every local chunk must be covered, or it
is an error naming it; LoRA adapters (models/lora.py) are not the base's and keep their initial
values. The caller refreshes the optimizer's copies (load_hf_into_trainer does).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from bapo_megatron.common.hf_io import HFCheckpoint
from bapo_megatron.models.lora import is_adapter
from bapo_megatron.models.recipes import grouped_experts
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.dist_ckpt import unwrap
from bapo_megatron.weights.layout import layer_impl, megatron_recipes, recipe_region

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


def _global_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its TP=1, EP=1 name in the whole model (layer numbers global, as with PP/VPP;
    expert numbers global, as with EP)."""
    named = [*model.named_parameters(), *model.named_buffers()]  # a router's expert bias is a buffer
    return {id(param): global_name(model, name) for name, param in named}


_LOCAL_EXPERT = re.compile(
    r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$|^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$"
)


def expert_parts(suffix: str) -> tuple[str, int, str] | None:
    """A layer's expert parameter name (within the layer) as (prefix, local expert, rest), in either
    naming (one expert after another, or TE's grouped GEMM); None: not an expert's."""
    match = _LOCAL_EXPERT.match(suffix)
    if match is None:
        return None
    return (match[1], int(match[2]), match[3]) if match[1] else (match[4], int(match[5]), "")


def global_name(model: torch.nn.Module, name: str) -> str:
    """A parameter's name in the whole model, from its name in this rank's chunk `model`: the
    chunk's layer index made the global layer, a local expert index the global expert."""
    if not name.startswith("decoder.layers."):
        return name
    _, _, local, suffix = name.split(".", 3)
    layer = model.decoder.layers[int(local)]
    parts = expert_parts(suffix)
    if parts is not None:
        head, index, tail = parts
        suffix = f"{head}{layer.mlp.local_expert_indices[index]}{tail}"
    return f"decoder.layers.{layer.layer_number - 1}.{suffix}"


def load_hf_weights(model_chunks: list[torch.nn.Module], spec: ModelSpec, hf: HFCheckpoint, padded_vocab: int) -> int:
    """Copy the HF checkpoint into this rank's chunks; returns the bytes copied."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    if hf.spec != spec:
        raise ValueError(f"{hf.dir}: its config.json describes another model than the trainer's")
    copied = 0
    for chunk in model_chunks:
        model = unwrap(chunk)
        params = dict(model.named_parameters())
        impl = layer_impl(n for n in params if n.startswith("decoder.layers.")) if model.decoder.layers else "local"
        recipes = megatron_recipes(spec, padded_vocab, impl, grouped_experts(params))
        if spec.tie_embeddings:  # the last stage's copy of a tied embedding (PP > 1) is the embedding too
            recipes[OUTPUT] = recipes[EMBEDDING]
        names = _global_names(model)
        covered = dict.fromkeys(names, 0)
        sharded = model.sharded_state_dict()
        apply_factories(sharded)  # the gated fc1's two halves: two shards of one parameter
        with torch.no_grad():
            for sh in (v for v in nested_values(sharded) if isinstance(v, ShardedTensor)):
                data = sh.data
                param = data if data._base is None else data._base
                name = names.get(id(param))
                if name is not None and is_adapter(name):
                    continue  # not the base's: it keeps its initial value (B zero: the base's outputs)
                if name is None or name not in recipes:
                    raise ValueError(f"the model's {sh.key} has no Hugging Face source (layout map and model disagree)")
                start, whole = tuple(sh.global_offset[sh.prepend_axis_num :]), sh.global_shape[sh.prepend_axis_num :]
                data.copy_(recipe_region(recipes[name], hf, start, tuple(sh.local_shape), tuple(whole), sh.key))
                covered[id(param)] += data.numel()
                copied += data.numel() * data.element_size()
        missing = [n for n, p in params.items() if covered[id(p)] != p.numel() and not is_adapter(n)]
        if missing:
            raise ValueError(f"{hf.dir}: no weights were loaded into {missing[:3]}")
    return copied


def load_hf_into_trainer(trainer, hf_dir: str | Path) -> int:
    """A PolicyTrainer's weights from a Hugging Face directory (safetensors), each rank its own slices,
    streamed tensor by tensor; then the optimizer's main parameters are refreshed from them (Megatron's
    reload_model_params: with bf16/fp8 parameters the next step would otherwise write the old values
    back). Returns the bytes this rank copied."""
    copied = load_hf_weights(
        trainer.model, trainer.spec, HFCheckpoint(hf_dir), trainer.vocab_local * trainer.info.tp_size
    )
    trainer.optimizer.reload_model_params()
    return copied
