"""PEFT's LoRA on a transformers model as the LoRA tests compare ours with: the model with our adapter
config's target modules, its adapters' names and shapes, and the merge check."""

from __future__ import annotations

import copy

import torch

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.lora import adapter_names, merge_adapters, peft_config
from bapo_megatron.models.spec import ModelSpec


def peft_model(model, spec: ModelSpec, lora: LoRAConfig):
    """A copy of `model` under PEFT's LoRA on the target modules our adapter config names."""
    import peft

    targets = peft_config(spec, lora, None)["target_modules"]
    return peft.get_peft_model(
        copy.deepcopy(model), peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets)
    )


def peft_shapes(peft_wrapped) -> dict[str, torch.Size]:
    """PEFT's adapter tensors by their saved names (no adapter name), with their shapes."""
    return {n.replace(".default.", "."): p.shape for n, p in peft_wrapped.named_parameters() if p.requires_grad}


def assert_merge_is_pefts(spec: ModelSpec, model, lora: LoRAConfig) -> None:
    """Random adapters merged by us (HF -> Megatron, merge_adapters, Megatron -> HF) equal PEFT's
    merge_and_unload of the same adapters, and change exactly the adapted weights."""
    import peft

    from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf
    from tests.families import hf_state

    theirs = peft_model(model, spec, lora)
    shapes = peft_shapes(theirs)
    names, g = adapter_names(spec, lora), torch.Generator().manual_seed(1)
    adapters = {ours: 0.1 * torch.randn(shapes[p], generator=g) for ours, p in names.items()}
    peft.set_peft_model_state_dict(theirs, {names[k]: v for k, v in adapters.items()})
    reference = hf_state(theirs.merge_and_unload())
    hf = {k: v.detach().clone() for k, v in hf_state(model).items()}
    mg = {**hf_to_megatron(spec, hf, spec.vocab_size, "local"), **adapters}
    merged = megatron_to_hf(spec, merge_adapters(spec, mg, lora.alpha / lora.rank), "local")
    changed = {k for k in merged if not torch.equal(merged[k], hf[k])}
    assert changed == {p.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight" for p in names.values()}
    for k in merged:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-6, atol=1e-6, msg=k)
