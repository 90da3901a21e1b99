"""Hugging Face <-> Megatron-Core parameter names and layouts of whole models, full tensors.

Each family (models/) says what its decoder layers are (layer_recipes, layer_to_hf); the embedding
(and an untied output layer), padded to the Megatron vocabulary size on import and trimmed on
export, and the final norm are every family's. With Transformer Engine's layer spec the two RMSNorm
weights live inside the following linear layer (`layer_norm_weight`), except before a MoE layer's
experts, whose norm is a module of its own (`pre_mlp_layernorm`) under either spec. HF names are
those of checkpoints on disk and of SGLang's loader (one tensor per expert), not transformers'
in-memory fusion. Tensors here are whole (TP = 1, EP = 1, E a global expert index); sharding over
tensor, pipeline and expert parallel ranks is dist_checkpointing's job, and the live export gathers
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from functools import partial

import torch

from bapo_megatron.models import family_of
from bapo_megatron.models.lora import is_adapter
from bapo_megatron.models.recipes import Fused, Parts, Recipe, Rows, norm_names, pad_vocab
from bapo_megatron.models.spec import ModelSpec


def layer_impl(names: Iterable[str]) -> str:
    """Which layer spec made a decoder layer, from its parameter names: Transformer Engine fuses
    norms into the linear layers after them (`layer_norm_weight`: linear_qkv's, linear_fc1's, the
    latent up-projections' of multi-latent attention, whose input norm stays a module of its own),
    the local spec keeps them all as modules of their own."""
    names = list(names)
    if any(n.endswith("layer_norm_weight") for n in names):
        return "transformer_engine"
    if any(n.endswith(norm_names("local")[0]) for n in names):
        return "local"
    raise ValueError(f"a decoder layer with neither spec's input norm: {names[:4]}")


def megatron_layer_to_hf(
    spec: ModelSpec, i: int, mg: Mapping[str, torch.Tensor], impl: str = "local"
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of decoder layer i, read from Megatron names in `mg` (experts by
    global index, in either naming)."""
    return family_of(spec).layer_to_hf(spec, i, mg, impl)


def recipe_region(
    recipe: Recipe,
    hf: Mapping[str, torch.Tensor],
    start: tuple[int, ...],
    shape: tuple[int, ...],
    whole: tuple[int, ...],
    key: str = "",
) -> torch.Tensor:
    """The region [start, start + shape) of the TP=1 tensor (of shape `whole`) that `recipe` makes:
    the tensor itself, the HF tensor that is exactly those rows (no copy), or a slice. `key`: the
    sharded tensor's, which names the part of a tensor Megatron shards part by part (Parts)."""
    if isinstance(recipe, Parts):
        recipe = recipe.part(key)
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
    recipes: dict[str, Recipe] = {"embedding.word_embeddings.weight": Fused(pad, ("model.embed_tokens.weight",))}
    family = family_of(spec)
    for i in range(spec.num_layers):
        recipes.update(family.layer_recipes(spec, i, impl, grouped))
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
    """A whole Megatron TP=1 state dict as HF names and shapes, vocabulary padding trimmed; one with
    LoRA adapters is refused (merge them first: models/lora.py merge_adapters), not exported without them."""
    adapters = [name for name in mg if is_adapter(name)]
    if adapters:
        raise ValueError(
            f"LoRA adapters {adapters[:2]} have no HF name of their own: merge them first (merge_adapters)"
        )
    vocab = spec.vocab_size
    out = {"model.embed_tokens.weight": mg["embedding.word_embeddings.weight"][:vocab]}
    for i in range(spec.num_layers):
        out.update(megatron_layer_to_hf(spec, i, mg, impl))
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    if not spec.tie_embeddings:
        out["lm_head.weight"] = mg["output_layer.weight"][:vocab]
    return out
