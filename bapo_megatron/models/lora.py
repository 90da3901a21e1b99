"""The one map of LoRA adapter names, Megatron's and PEFT's, over the targets each family gives.

A target is a Hugging Face projection (q_proj, ..., down_proj; Qwen3.5's in_proj_qkv, ...): which a
layer has, and which Megatron linear layer computes it, is its family's answer (Family.lora_targets,
Family.lora_layout; the types in models/lora_targets.py); a family that gives none is refused by name.
Megatron fuses some projections into one linear layer: q/k/v into `linear_qkv` (rows interleaved per
query group, models/recipes.py), gate/up into `linear_fc1` ([gate; up]), Qwen3.5's delta-rule inputs
into `in_proj`; each target keeps an adapter of its own whose B writes only its rows of the fused
output (a q_proj adapter leaves k and v as they are), so an adapter is exactly PEFT's on the HF
model. Megatron's name of an adapter is `<layer>.<module>_lora.<target>.lora_A.weight` (its module's
sibling, so that the base's names and checkpoint keys stay as they are); PEFT's is
`base_model.model.model.layers.<i>.<HF module>.lora_A.weight`, as adapter_model.safetensors holds it.

How a TP rank holds an adapter follows its base layer: beside a column-parallel layer A is whole and
B split by rows as the base weight is (whole where the base splits the target's rows part by part);
beside a row-parallel one A is split by columns and B whole. merge_adapters folds whole adapters
into their base weights, for whoever reads the model without LoRA (the engines' weight sync, the
merged HF export).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

import torch

from bapo_megatron.config.lora import ALL_LINEAR, LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.lora_experts import (
    check_experts,
    expert_layout,
    expert_targets,
    is_expert_module,
    peft_target_parameters,
)
from bapo_megatron.models.lora_targets import Slots, Target
from bapo_megatron.models.spec import ModelSpec

PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in the transformers model (PeftModel.base_model.model)."""
SUFFIX = "_lora"
"""A Megatron adapter module's name: its base module's name and this."""
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""A PEFT adapter directory's two files (what peft, transformers, SGLang and vLLM load)."""


def _targets_of(spec: ModelSpec, layer: int) -> dict[str, Target]:
    """Every projection of layer `layer` LoRA can adapt, by HF name (the family's answer)."""
    return family_of(spec).lora_targets(spec, layer) or {}


def check_targets(spec: ModelSpec, lora: LoRAConfig) -> None:
    """ConfigError (naming model.lora's field and the valid names) unless `lora` can adapt `spec`."""
    family = family_of(spec)
    if family.lora_targets(spec, 0) is None:
        raise ConfigError("model.lora.rank", lora.rank, f"LoRA is not built for the family {spec.architecture!r} yet")
    if lora.experts:
        check_experts(spec, lora, family.lora_experts)
    every = {name: t for i in range(spec.num_layers) for name, t in _targets_of(spec, i).items()}
    valid = (ALL_LINEAR, *every)
    unknown = [t for t in lora.target_modules if t not in valid]
    if unknown:
        routed = " (a routed layer's experts: model.lora.experts)" if spec.moe is not None else ""
        raise ConfigError(
            "model.lora.target_modules",
            unknown,
            f"not a projection of {spec.architecture}{routed}; valid: {list(valid)}",
        )
    unserved = [t for t in lora.target_modules if t in every and not every[t].served_beside(lora.target_modules)]
    if unserved and lora.adapter_sync:
        pairs = "".join(f" ({t} only beside {list(every[t].served_with)})" for t in unserved if every[t].served)
        raise ConfigError(
            "model.lora.target_modules",
            unserved,
            f"SGLang 0.5.23 serves no adapter of {spec.architecture}'s {unserved} from PEFT's tensors{pairs}: "
            "train them with model.lora.sync=merged, or leave them out",
        )


def layer_targets(spec: ModelSpec, lora: LoRAConfig, layer: int) -> tuple[Target, ...]:
    """The adapted projections of 0-based layer `layer`, in the family's order, then with
    model.lora.experts every routed expert's (models/lora_experts.py; not adapted otherwise)."""
    available = _targets_of(spec, layer)
    experts = expert_targets(spec, layer) if lora.experts else ()
    if ALL_LINEAR in lora.target_modules:
        return tuple(t for t in available.values() if t.served or not lora.adapter_sync) + experts
    return tuple(t for name, t in available.items() if name in lora.target_modules) + experts


def served_modules(spec: ModelSpec, lora: LoRAConfig) -> tuple[str, ...]:
    """The HF projection names of every adapted module (the experts': their fused gate_up_proj and
    down_proj): the target modules an SGLang server is launched with for the adapters it is sent."""
    return tuple(sorted({t.name for layer in range(spec.num_layers) for t in layer_targets(spec, lora, layer)}))


def peft_unloadable(spec: ModelSpec, lora: LoRAConfig) -> list[str]:
    """The adapted dense-layer MLP modules peft would not load from a PEFT adapter directory (the
    family's Family.peft_reads_mlp_as_experts: a Qwen3-MoE with dense layers, mlp_only_layers)."""
    if spec.moe is None or not family_of(spec).peft_reads_mlp_as_experts:
        return []
    return [
        f"model.layers.{layer}.{t.hf_module}"
        for layer in range(spec.num_layers)
        if not spec.moe.is_sparse(layer)
        for t in layer_targets(spec, lora, layer)
        if t.hf_module.startswith("mlp.")
    ]


def slots(spec: ModelSpec, layer: int, module: str, tp: int) -> Slots:
    """The layout of one TP rank's output of the column-parallel `module` of layer `layer` (of layer_targets;
    an expert's at its expert TP `tp`)."""
    if is_expert_module(module):
        return expert_layout(spec).rank(tp)
    return family_of(spec).lora_layout(spec, layer, module).rank(tp)


def megatron_rows(y: torch.Tensor, layout: Slots, name: str) -> torch.Tensor:
    """Target `name`'s output (last dim: `layout.groups` groups of its HF rows) in the order Megatron's
    fused layer holds its rows (a paired part's a heads, then its b heads; Slots.reorder's)."""
    y = layout.reorder(y, name)
    head = dict(layout.paired).get(name)
    if head is None:
        return y
    lead = y.shape[:-1]
    pairs = y.reshape(*lead, layout.groups, -1, 2, head)
    return pairs.transpose(-3, -2).reshape(*lead, -1)


def megatron_name(layer: int, target: Target, matrix: Literal["A", "B"]) -> str:
    """Megatron's name of an adapter matrix (0-based global layer, as a TP = 1, PP = 1 model names it)."""
    return f"decoder.layers.{layer}.{target.module}{SUFFIX}.{target.name}.lora_{matrix}.weight"


def peft_name(layer: int, target: Target, matrix: Literal["A", "B"]) -> str:
    """PEFT's name of the same matrix in adapter_model.safetensors."""
    return f"{PEFT_PREFIX}model.layers.{layer}.{target.hf_module}.lora_{matrix}.weight"


def adapter_names(spec: ModelSpec, lora: LoRAConfig) -> dict[str, str]:
    """Every adapter matrix of the model: Megatron's name -> PEFT's name."""
    names = {}
    for layer in range(spec.num_layers):
        for target in layer_targets(spec, lora, layer):
            for matrix in ("A", "B"):
                names[megatron_name(layer, target, matrix)] = peft_name(layer, target, matrix)
    return names


def is_adapter(name: str) -> bool:
    """Whether a Megatron parameter (or state dict key) is an adapter's."""
    return f"{SUFFIX}." in name and (".lora_A." in name or ".lora_B." in name)


def adapter_params(spec: ModelSpec, lora: LoRAConfig, layers: list[int], tp: int, ep: int = 1) -> int:
    """The adapters' parameters one TP rank holds for `layers` (0 with LoRA off), of the routed experts
    those of its expert-parallel rank (1 / `ep` of them, each whole: expert TP 1); ConfigError where
    `lora` cannot adapt `spec` (so the memory estimate and the dry run say so before any process)."""
    if not lora.enabled:
        return 0
    check_targets(spec, lora)
    total, experts = 0, 0
    for layer in layers:
        for t in layer_targets(spec, lora, layer):
            if is_expert_module(t.module):
                experts += t.params(lora.rank, 1)
            else:
                total += t.params(lora.rank, tp)
    return total + experts // ep


def merge_adapters(spec: ModelSpec, tensors: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """Whole (TP = 1) Megatron tensors of decoder layers (global names, as megatron_name's) with each
    adapter folded into its base weight, W + scaling B A, and the adapters left out: the model the
    trainer computes, for a reader that knows no LoRA (an engine, transformers). A fused base (q/k/v,
    gate/up) takes each adapter's B A in its target's rows, as the adapters' forward writes them."""
    out = {name: t for name, t in tensors.items() if not is_adapter(name)}
    by_base: dict[str, list[tuple[Target, str]]] = {}
    for name in tensors:
        match = _ADAPTER_A.fullmatch(name)
        if match is None:
            continue
        layer, module, target = int(match["layer"]), match["module"], match["target"]
        base = f"decoder.layers.{layer}.{module}.weight"
        if base not in out and not _stored_parts(out, base):
            raise ValueError(f"adapter {name} has no base weight {base} beside it")
        by_base.setdefault(base, []).append((_target(spec, layer, module, target), name[: -len("A.weight")]))
    for base, adapters in by_base.items():
        parts = _stored_parts(out, base)
        weight = out[base] if base in out else torch.cat([out.pop(p) for p in parts])
        # in float32: a bf16 base is rounded once, from the merged weight
        deltas = {t.name: scaling * (_f32(tensors, p + "B") @ _f32(tensors, p + "A")) for t, p in adapters}
        if adapters[0][0].parallel == "row":
            (delta,) = deltas.values()
        else:
            layer = int(base.split(".")[2])
            layout = slots(spec, layer, adapters[0][0].module, 1)
            rows = []
            for name, width in layout.parts:
                part = deltas.get(name)
                if part is None:  # a projection of the fused layer that is not adapted
                    part = weight.new_zeros(layout.groups * width, weight.shape[1], dtype=torch.float32)
                part = megatron_rows(part.T, layout, name).T  # rows as Megatron's fused layer holds them
                rows.append(part.reshape(layout.groups, width, -1))
            delta = torch.cat(rows, dim=1).reshape(weight.shape)
        merged = (weight.float() + delta).to(weight.dtype)
        if base in out:
            out[base] = merged
        else:  # back into the parts it was read as
            out |= dict(zip(parts, merged.split([tensors[p].shape[0] for p in parts]), strict=True))
    return out


def _target(spec: ModelSpec, layer: int, module: str, name: str) -> Target:
    """Layer `layer`'s target `name` of Megatron module `module` (a routed expert's too)."""
    if is_expert_module(module):
        return next(t for t in expert_targets(spec, layer) if t.module == module and t.name == name)
    return _targets_of(spec, layer)[name]


def _stored_parts(tensors: Mapping[str, torch.Tensor], base: str) -> list[str]:
    """The keys of a base weight a dist checkpoint stores part by part (Gated DeltaNet's in_proj:
    `in_proj.weight.query`, ...), in the order its family's stored shapes give them (the rows' order)."""
    return [k for k in tensors if k.startswith(base + ".") and not is_adapter(k)]


def _f32(tensors: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return tensors[f"{prefix}.weight"].float()


_ADAPTER_A = re.compile(rf"decoder\.layers\.(?P<layer>\d+)\.(?P<module>.+){SUFFIX}\.(?P<target>\w+)\.lora_A\.weight")


def peft_config(spec: ModelSpec, lora: LoRAConfig, base: str | None) -> dict:
    """The adapters' PEFT adapter_config.json (what peft, SGLang and the embedded engine read), naming
    `base`: target_modules by projection name, or by full module name where a mixture-of-experts
    model has routed experts of the same name; with model.lora.experts, the experts' fused tensors
    as target_parameters (models/lora_experts.py)."""
    layers = [
        [t for t in layer_targets(spec, lora, i) if not is_expert_module(t.module)] for i in range(spec.num_layers)
    ]
    targets = sorted({t.name for adapted in layers for t in adapted})
    if spec.moe is not None:
        targets = sorted({f"model.layers.{i}.{t.hf_module}" for i, adapted in enumerate(layers) for t in adapted})
    experts = {"target_parameters": peft_target_parameters(spec)} if lora.experts else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        **experts,
    }
