"""Which projections of a family LoRA adapts, and the one map of adapter names: Megatron's and PEFT's.

A target is a Hugging Face projection (q_proj, ..., down_proj). Megatron fuses some of them into one
linear layer: q/k/v into `linear_qkv` (rows interleaved per query group, models/recipes.py) and
gate/up into `linear_fc1` ([gate; up]); each target keeps an adapter of its own whose B writes only
its rows of the fused output (a q_proj adapter leaves k and v as they are), so an adapter is exactly
PEFT's on the HF model. Megatron's name of an adapter is `<layer>.<module>_lora.<target>.lora_A.weight`
(its module's sibling, so that the base's names and checkpoint keys stay as they are); PEFT's is
`base_model.model.model.layers.<i>.<HF module>.lora_A.weight`, as adapter_model.safetensors holds it.

How a TP rank holds an adapter follows its base layer: beside a column-parallel layer A is whole and
B split by rows as the base weight is; beside a row-parallel one A is split by columns and B whole.
merge_adapters folds whole adapters into their base weights, for whoever reads the model without
LoRA (the engines' weight sync, the merged HF export).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from bapo_megatron.config.lora import ALL_LINEAR, LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import ModelSpec

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe")
"""The families whose layers are the shared decoder's (models/decoder.py): standard attention and,
where a layer has no routed experts, a gated MLP. Another family's attention (latent, linear,
with sinks) is not adapted yet."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module's name in the transformers model (PeftModel.base_model.model)."""
SUFFIX = "_lora"
"""A Megatron adapter module's name: its base module's name and this."""
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
"""A PEFT adapter directory's two files (what peft, transformers, SGLang and vLLM load)."""


@dataclass(frozen=True)
class Target:
    """One adapted HF projection of a layer, and where it lives in Megatron's layer."""

    name: str
    """The HF projection: "q_proj"."""
    hf_module: str
    """Its module within an HF layer: "self_attn.q_proj"."""
    module: str
    """The Megatron linear layer within a layer that computes it: "self_attention.linear_qkv"."""
    parallel: Literal["column", "row"]
    """How Megatron splits the base layer over TP (and so the adapter: B rows, or A columns)."""
    in_features: int
    out_features: int
    """The whole (TP = 1) projection's shape, as HF's weight [out, in]."""

    def split_dim(self, matrix: Literal["A", "B"]) -> int | None:
        """The dimension of lora_A / lora_B ([rank, in] / [out, rank]) split over TP; None: whole."""
        if self.parallel == "column":
            return 0 if matrix == "B" else None
        return 1 if matrix == "A" else None

    def params(self, rank: int, tp: int) -> int:
        """The adapter's parameters on one TP rank."""
        a, b = rank * self.in_features, self.out_features * rank
        return a + b // tp if self.parallel == "column" else a // tp + b


@dataclass(frozen=True)
class Slots:
    """How one TP rank's output of a fused column-parallel layer is laid out: `groups` repeats of the
    parts, each part `width` features wide (q/k/v: a query group's q heads, its k head, its v head)."""

    groups: int
    parts: tuple[tuple[str, int], ...]
    """(target name, width) in the order the fused output holds them."""


def _targets_of(spec: ModelSpec, layer: int) -> dict[str, Target]:
    """Every projection of layer `layer` LoRA can adapt, by HF name."""
    d, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    qkv = "self_attention.linear_qkv"
    out = {
        "q_proj": Target("q_proj", "self_attn.q_proj", qkv, "column", d, q),
        "k_proj": Target("k_proj", "self_attn.k_proj", qkv, "column", d, kv),
        "v_proj": Target("v_proj", "self_attn.v_proj", qkv, "column", d, kv),
        "o_proj": Target("o_proj", "self_attn.o_proj", "self_attention.linear_proj", "row", q, d),
    }
    if spec.moe is None or not spec.moe.is_sparse(layer):
        width = spec.ffn_hidden_size
        out["gate_proj"] = Target("gate_proj", "mlp.gate_proj", "mlp.linear_fc1", "column", d, width)
        out["up_proj"] = Target("up_proj", "mlp.up_proj", "mlp.linear_fc1", "column", d, width)
        out["down_proj"] = Target("down_proj", "mlp.down_proj", "mlp.linear_fc2", "row", width, d)
    return out


def check_targets(spec: ModelSpec, lora: LoRAConfig) -> None:
    """ConfigError (naming model.lora's field and the valid names) unless `lora` can adapt `spec`."""
    if spec.architecture not in FAMILIES:
        raise ConfigError(
            "model.lora.rank", lora.rank, f"LoRA is built for the families {list(FAMILIES)}, not {spec.architecture!r}"
        )
    if lora.experts:
        raise ConfigError(
            "model.lora.experts",
            lora.experts,
            "LoRA on a mixture-of-experts layer's routed experts is not built yet; leave it false "
            "(attention and dense MLPs are adapted)",
        )
    valid = (ALL_LINEAR, *ATTENTION, *MLP)
    unknown = [t for t in lora.target_modules if t not in valid]
    if unknown:
        raise ConfigError(
            "model.lora.target_modules", unknown, f"not a projection of {spec.architecture}; valid: {list(valid)}"
        )
    layers = range(spec.num_layers)
    nowhere = [t for t in lora.target_modules if t in MLP and not any(t in _targets_of(spec, i) for i in layers)]
    if nowhere:
        raise ConfigError(
            "model.lora.target_modules",
            nowhere,
            f"every layer of this {spec.architecture} routes its MLP to experts (model.lora.experts is not "
            f"built yet); valid: {[ALL_LINEAR, *ATTENTION]}",
        )


def layer_targets(spec: ModelSpec, lora: LoRAConfig, layer: int) -> tuple[Target, ...]:
    """The adapted projections of 0-based layer `layer`, in the family's order (a MoE layer's MLP is
    its experts': not adapted, unless a dense layer has one)."""
    available = _targets_of(spec, layer)
    wanted = available if ALL_LINEAR in lora.target_modules else lora.target_modules
    return tuple(t for name, t in available.items() if name in wanted)


def slots(spec: ModelSpec, module: str, tp: int) -> Slots:
    """The layout of one TP rank's output of the column-parallel `module` (of layer_targets)."""
    if module == "self_attention.linear_qkv":
        hd, per_group = spec.head_dim, spec.num_heads // spec.num_kv_heads
        return Slots(spec.num_kv_heads // tp, (("q_proj", per_group * hd), ("k_proj", hd), ("v_proj", hd)))
    assert module == "mlp.linear_fc1", module
    width = spec.ffn_hidden_size // tp
    return Slots(1, (("gate_proj", width), ("up_proj", width)))


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


def adapter_params(spec: ModelSpec, lora: LoRAConfig, layers: list[int], tp: int) -> int:
    """The adapters' parameters one TP rank holds for `layers` (0 with LoRA off); ConfigError where
    `lora` cannot adapt `spec` (so the memory estimate and the dry run say so before any process)."""
    if not lora.enabled:
        return 0
    check_targets(spec, lora)
    return sum(t.params(lora.rank, tp) for layer in layers for t in layer_targets(spec, lora, layer))


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
        if base not in out:
            raise ValueError(f"adapter {name} has no base weight {base} beside it")
        by_base.setdefault(base, []).append((_targets_of(spec, layer)[target], name[: -len("A.weight")]))
    for base, adapters in by_base.items():
        weight = out[base]
        # in float32: a bf16 base is rounded once, from the merged weight
        deltas = {t.name: scaling * (_f32(tensors, p + "B") @ _f32(tensors, p + "A")) for t, p in adapters}
        if adapters[0][0].parallel == "row":
            (delta,) = deltas.values()
        else:
            layout = slots(spec, adapters[0][0].module, 1)
            rows = []
            for name, width in layout.parts:
                part = deltas.get(name)
                if part is None:  # a projection of the fused layer that is not adapted
                    part = weight.new_zeros(layout.groups * width, weight.shape[1], dtype=torch.float32)
                rows.append(part.view(layout.groups, width, -1))
            delta = torch.cat(rows, dim=1).reshape(weight.shape)
        out[base] = (weight.float() + delta).to(weight.dtype)
    return out


def _f32(tensors: Mapping[str, torch.Tensor], prefix: str) -> torch.Tensor:
    return tensors[f"{prefix}.weight"].float()


_ADAPTER_A = re.compile(rf"decoder\.layers\.(?P<layer>\d+)\.(?P<module>.+){SUFFIX}\.(?P<target>\w+)\.lora_A\.weight")


def peft_config(spec: ModelSpec, lora: LoRAConfig, base: str | None) -> dict:
    """The adapters' PEFT adapter_config.json (what peft, SGLang and the embedded engine read), naming
    `base`: target_modules by projection name, or by full module name where a mixture-of-experts
    model has routed experts of the same name that are not adapted (model.lora.experts)."""
    names = adapter_names(spec, lora)
    targets = sorted({t.name for i in range(spec.num_layers) for t in layer_targets(spec, lora, i)})
    if spec.moe is not None:
        targets = sorted({n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0] for n in names.values()})
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
    }
