"""A LoRA run's adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors),
which peft.PeftModel.from_pretrained loads onto the Hugging Face base model (and SGLang and vLLM
serve as a LoRA adapter). Names and shapes are models/lora.py's map: Megatron's adapter -> PEFT's; the
routed experts' adapters (model.lora.experts) stacked as PEFT holds them on transformers 5's fused
expert tensors (models/lora_experts.py)."""

from __future__ import annotations

import json
from pathlib import Path

from bapo_megatron.fsutil import atomic_directory
from bapo_megatron.models.lora import (
    PEFT_CONFIG,
    PEFT_PREFIX,
    PEFT_WEIGHTS,
    adapter_names,
    peft_config,
    peft_unloadable,
)
from bapo_megatron.models.lora_experts import peft_stacked
from bapo_megatron.models.on_disk import CANONICAL_PREFIX, DiskLayout
from bapo_megatron.trainer.checkpoint import weights_dir
from bapo_megatron.trainer.dist_ckpt import saved_model_config
from bapo_megatron.weights.mcore_io import McoreCheckpoint


def write_peft_adapter(mcore_dir: str | Path, out: str | Path, base: str | None = None) -> Path:
    """The adapters of `mcore_dir` (a LoRA run's step, or its checkpoint.dir: the step a resume would
    load) as a PEFT adapter directory `out`; `base`: the base model it names (default: the run's
    model.hf_path). ValueError for a checkpoint without adapters, or with adapters peft would not
    load (models/lora.peft_unloadable)."""
    from safetensors.torch import save_file

    source = McoreCheckpoint(weights_dir(mcore_dir))
    lora, spec = source.lora, source.spec
    if lora is None:
        raise ValueError(f"{source.dir}: holds no LoRA adapters (not a model.lora run's checkpoint)")
    unloadable = peft_unloadable(spec, lora)
    if unloadable:
        raise ValueError(
            f"{source.dir}: peft 0.21 on transformers 5 reads {spec.architecture}'s gate_proj / up_proj / "
            f"down_proj as its routed experts', so the adapters of its dense layers' MLPs ({unloadable[0]}, "
            f"{len(unloadable)} in all) would not be loaded from a PEFT adapter: write the merged model "
            "(mcore-to-hf --out) instead, or train without MLP targets (model.lora.target_modules)"
        )
    names = adapter_names(spec, lora)
    tensors = {}
    for layer in range(spec.num_layers):
        for name, tensor in source.adapters(layer).items():
            tensors[names[name]] = tensor.contiguous()
    missing = sorted(names.values() - tensors.keys())
    if missing:
        raise ValueError(f"{source.dir}: lacks the adapters {missing[:3]} its model.lora config implies")
    if lora.experts:
        tensors = peft_stacked(spec, tensors)
    config = peft_config(spec, lora, base or saved_model_config(source.dir).get("hf_path"))
    tensors, config = on_disk(tensors, config, source.layout)
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / PEFT_WEIGHTS), metadata={"format": "pt"})
        (tmp / PEFT_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)


def on_disk(tensors: dict, config: dict, layout: DiskLayout) -> tuple[dict, dict]:
    """The adapter's tensor names and full module names (target_modules, target_parameters) as the
    base's layout names its modules: a released Qwen3.5 (Qwen3_5ForConditionalGeneration) holds the
    text model under model.language_model., where peft looks for its adapters."""

    def name(canonical: str) -> str:
        return layout.disk_name(canonical) if canonical.startswith(CANONICAL_PREFIX) else canonical

    renamed = {PEFT_PREFIX + name(n.removeprefix(PEFT_PREFIX)): t for n, t in tensors.items()}
    lists = {key: [name(m) for m in config[key]] for key in ("target_modules", "target_parameters") if key in config}
    return renamed, config | lists
