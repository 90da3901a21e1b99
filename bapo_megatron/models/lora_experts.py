"""LoRA on the routed experts of a mixture-of-experts layer (model.lora.experts): each expert's adapters,
their names in Megatron, in SGLang's per-expert keys and in PEFT's stacked layout.

Megatron's local spec runs a rank's experts one after another (SequentialMLP): each an MLP whose
linear_fc1 ([gate; up]) and linear_fc2 are column- and row-parallel over the expert TP group, of size
1 here (an expert is never split: trainer/megatron_config.py), its experts placed over EP. Every
expert gets two adapters, as PEFT adapts transformers 5's fused expert tensors (gate_up_proj [E, 2w, d]
and down_proj [E, d, w], by `target_parameters`: one rank-r adapter an expert and tensor). Qwen3-MoE,
Qwen3.5-MoE, Qwen3-Next, GLM-4.5 and DeepSeek-V3 lay their experts out so (Family.lora_experts; a
shared expert or dense MLP beside them is no `mlp.experts.` tensor); gpt-oss's are [E, d, 2w] and
[E, w, d] (x @ W), its gate and up columns interleaved (Family.lora_experts_interleaved: PEFT's B
rows follow them; SGLang's per-expert B stays [gate; up], its FusedMoE interleaving it). A family
laid out otherwise is refused by name, and so is sync "adapter" where SGLang serves no expert
adapter of the family (Family.lora_experts_unserved). An expert's two adapters:
  - gate_up_proj beside its linear_fc1: A [r, d], B [2w, r] writing gate and up rows together;
  - down_proj beside its linear_fc2: A [r, w], B [d, r].
Their names:
  - Megatron's: `decoder.layers.L.mlp.experts.local_experts.E.linear_fc1_lora.gate_up_proj.lora_A.weight`,
    E the global expert as one process names it (the rank that holds it uses its local index);
  - per expert, `base_model.model.model.layers.L.mlp.experts.E.gate_up_proj.lora_A.weight`: models/lora.py's
    adapter_names and what the adapter sync sends, SGLang 0.5.23's per-expert key (its loader files an
    `experts.<E>.` key under expert E and repeats gate_up_proj's A for the gate and the up rows);
  - PEFT's adapter_model.safetensors (peft_stacked): the experts of a layer stacked as PEFT's
    ParamWrapper holds them, A [E r, in] (expert-major rows), B [out, r E] (column k E + e is
    expert e's column k); down_proj's wrapper wraps gate_up_proj's (PEFT wraps a module's parameters
    in their order), so gate_up_proj's matrices are `mlp.experts.base_layer.lora_A.weight`, down_proj's
    `mlp.experts.lora_A.weight`.
PEFT refuses dropout on a wrapped parameter (its delta is added to the weight, not to the output), and
so do these adapters.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.lora_targets import Layout, Target
from bapo_megatron.models.recipes import STORED_EXPERTS
from bapo_megatron.models.spec import ModelSpec

EXPERTS = "mlp.experts."
"""Where a routed layer's experts are, in Megatron's layer and in the HF layer."""
LOCAL = EXPERTS + "local_experts."
"""Megatron's experts one after another (SequentialMLP): `local_experts.<E>.linear_fc1`."""
FUSED = ("gate_up_proj", "down_proj")
"""transformers 5's fused expert tensors, as PEFT's target_parameters name them under `mlp.experts.`."""


def expert_targets(spec: ModelSpec, layer: int) -> tuple[Target, ...]:
    """Every expert's gate_up_proj and down_proj of layer `layer` (none in a dense layer)."""
    if spec.moe is None or not spec.moe.is_sparse(layer):
        return ()
    d, width = spec.hidden_size, spec.moe.ffn_hidden_size
    targets = []
    for e in range(spec.moe.num_experts):
        targets.append(
            Target("gate_up_proj", f"{EXPERTS}{e}.gate_up_proj", f"{LOCAL}{e}.linear_fc1", "column", d, 2 * width)
        )
        targets.append(Target("down_proj", f"{EXPERTS}{e}.down_proj", f"{LOCAL}{e}.linear_fc2", "row", width, d))
    return tuple(targets)


def is_expert_module(module: str) -> bool:
    """Whether a Megatron linear layer within a layer is a routed expert's."""
    return module.startswith(LOCAL)


def expert_layout(spec: ModelSpec) -> Layout:
    """An expert's linear_fc1 as its one adapter writes it: [gate; up], whole (expert TP 1)."""
    return Layout(1, (("gate_up_proj", 2 * spec.moe.ffn_hidden_size),), "widths")


def check_experts(spec: ModelSpec, lora: LoRAConfig, adapts_experts: bool, grouped: bool = False) -> None:
    """ConfigError, naming the field, where model.lora.experts cannot be built for `spec`: a family whose
    experts' HF layout is not handled (`adapts_experts`: its Family.lora_experts), dropout (PEFT refuses it
    on a wrapped parameter), Transformer Engine's grouped GEMM experts (one weight for all experts)."""
    if spec.moe is None:
        raise ConfigError("model.lora.experts", True, f"{spec.architecture} has no routed experts")
    if not adapts_experts:
        from bapo_megatron.models import FAMILIES  # the registry imports every family: asked here, not at import

        built = ", ".join(sorted(f.name for f in FAMILIES.values() if f.lora_experts))
        raise ConfigError(
            "model.lora.experts",
            True,
            f"LoRA on the routed experts of {spec.architecture} is not built yet (built for {built}); "
            "leave it false (attention, dense MLPs and shared experts are adapted)",
        )
    _check_served(spec, lora)
    if lora.dropout > 0:
        raise ConfigError(
            "model.lora.dropout",
            lora.dropout,
            "must be 0 with model.lora.experts (PEFT adds an expert's adapter to its weight, where dropout "
            "has no place, and refuses it)",
        )
    if grouped:
        raise ConfigError(
            "model.moe.grouped_gemm",
            True,
            "model.lora.experts adapts experts run one after another (Megatron's SequentialMLP); "
            "set model.moe.grouped_gemm=false",
        )


def interleaves(spec: ModelSpec) -> bool:
    """Whether `spec`'s family interleaves gate and up in its HF experts (Family.lora_experts_interleaved)."""
    from bapo_megatron.models import family_of  # the registry imports every family: asked here, not at import

    return family_of(spec).lora_experts_interleaved


def _check_served(spec: ModelSpec, lora: LoRAConfig) -> None:
    """ConfigError under model.lora.sync=adapter where SGLang serves none of the family's expert adapters
    (Family.lora_experts_unserved), as models/lora.py refuses the other unserved targets."""
    from bapo_megatron.models import family_of  # the registry imports every family: asked here, not at import

    reason = family_of(spec).lora_experts_unserved(spec) if lora.adapter_sync else None
    if reason is not None:
        raise ConfigError(
            "model.lora.experts",
            True,
            f"{reason}: train the experts' adapters with model.lora.sync=merged, or leave model.lora.experts false",
        )


def local_module(experts: torch.nn.Module, module: str) -> str | None:
    """The name within a layer of expert module `module` (global expert number) on this rank, by its
    local index; None where another expert-parallel rank holds the expert. `experts`: the layer's
    `mlp.experts` (SequentialMLP: its ep_group and num_local_experts)."""
    match = re.fullmatch(rf"{re.escape(LOCAL)}(\d+)(\..+)", module)
    assert match is not None, module
    n = experts.num_local_experts
    index = int(match[1]) - experts.ep_group.rank() * n
    return f"{LOCAL}{index}{match[2]}" if 0 <= index < n else None


def peft_target_parameters(spec: ModelSpec) -> list[str]:
    """adapter_config.json's target_parameters of routed-expert adapters (PEFT's names)."""
    return [EXPERTS + name for name in FUSED]


_PER_EXPERT = re.compile(r"(?P<head>.*\.mlp\.experts\.)(?P<expert>\d+)\.(?P<proj>\w+)\.lora_(?P<m>[AB])\.weight")


def peft_stacked(spec: ModelSpec, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors under models/lora.py's PEFT names with every layer's per-expert adapters stacked
    as PEFT holds them on transformers 5's fused expert tensors (the module says how); other tensors
    as they are. ValueError where a layer lacks an expert's matrix."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _PER_EXPERT.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            groups.setdefault((match["head"], match["proj"], match["m"]), {})[int(match["expert"])] = tensor
    experts = spec.moe.num_experts if spec.moe is not None else 0
    for (head, proj, matrix), by_expert in groups.items():
        if sorted(by_expert) != list(range(experts)):
            raise ValueError(f"{head}<E>.{proj}.lora_{matrix}: experts {sorted(by_expert)}, not all {experts}")
        ordered = [by_expert[e] for e in range(experts)]
        if matrix == "B" and proj == "gate_up_proj" and interleaves(spec):
            ordered = [interleaved(b) for b in ordered]  # PEFT's rows: HF's columns
        wrapper = "base_layer." if proj == "gate_up_proj" else ""
        stacked = torch.cat(ordered) if matrix == "A" else torch.stack(ordered, dim=-1).flatten(1)
        out[f"{head}{wrapper}lora_{matrix}.weight"] = stacked
    return out


def interleaved(b: torch.Tensor) -> torch.Tensor:
    """Rows [gate; up] as gate and up interleaved (gate even, up odd)."""
    gate, up = b.chunk(2)
    return torch.stack([gate, up], dim=1).flatten(0, 1)


def per_projection(
    spec: ModelSpec, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF weight: (A, B)}, B @ A its delta, for the weights a checkpoint on disk holds: an expert's
    gate_up_proj adapter as its gate_proj's and up_proj's (A shared, B's halves: rows [gate; up]); a
    layer's experts of a family that interleaves them (`interleaves`) as its fused tensors' (one per
    projection, [E, in, out]: A the experts' (interleaved) B transposed, B their A transposed)."""
    out, fused = {}, {}
    for weight, (a, b) in pairs.items():
        names, match = hf_weight_names(spec, weight), _EXPERT_WEIGHT.fullmatch(weight)
        if match is not None and interleaves(spec):
            b = interleaved(b) if match["proj"] == "gate_up_proj" else b
            fused.setdefault(names[0], {})[int(match["expert"])] = (a, b)
        elif len(names) == 1:
            out[weight] = (a, b)
        else:  # gate's rows, then up's
            out |= dict(zip(names, ((a, half) for half in b.chunk(2)), strict=True))
    for name, by_expert in fused.items():
        experts = [by_expert[e] for e in sorted(by_expert)]
        out[name] = (torch.stack([b.T for _, b in experts]), torch.stack([a.T for a, _ in experts]))
    return out


_GATE_UP = "gate_up_proj"


def hf_weight_names(spec: ModelSpec, weight: str) -> tuple[str, ...]:
    """The HF weights on disk an adapted weight name stands for: an expert's gate_up_proj its gate_proj
    and up_proj, or, in a family that interleaves, every expert's projection the layer's fused tensor
    (`mlp.experts.gate_up_proj`); others: itself."""
    match = _EXPERT_WEIGHT.fullmatch(weight)
    if match is None:
        return (weight,)
    if interleaves(spec):
        return (f"{match['head']}.{match['proj']}",)
    if match["proj"] != _GATE_UP:
        return (weight,)
    head = f"{match['head']}.{match['expert']}"
    return (f"{head}.gate_proj.weight", f"{head}.up_proj.weight")


_EXPERT_WEIGHT = re.compile(r"(?P<head>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")


def stored_per_expert(prefix: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A dist checkpoint's adapter `prefix + suffix` by Megatron's name; a routed expert's, stored over a
    leading [experts] axis as the experts' weights are (STORED_EXPERTS), one per expert under
    `mlp.experts.local_experts.<E>.` (global E)."""
    stacked = STORED_EXPERTS[0].rsplit(".", 2)[0] + "."  # mlp.experts.experts.
    if not suffix.startswith(stacked):
        return {prefix + suffix: tensor}
    rest = suffix.removeprefix(stacked)
    return {f"{prefix}{LOCAL}{e}.{rest}": t for e, t in enumerate(tensor)}
