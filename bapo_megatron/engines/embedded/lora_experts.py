"""The embedded engine's LoRA adapters on the routed experts (model.lora.experts): transformers 5's fused
experts (gate_up_proj [E, 2w, d], down_proj [E, d, w]; a module marked is_transposed holds them as
[E, d, 2w] and [E, w, d], and one not is_concatenated interleaves gate and up columns: gpt-oss) run a
request's rows with W + scaling B A, as PEFT's ParamWrapper computes them (its target_parameters),
the base weights untouched.

The tensors are what the adapter sync sends, SGLang's per-expert keys
(`base_model.model.model.layers.L.mlp.experts.E.gate_up_proj.lora_A.weight` [r, d], `lora_B` [2w, r];
down_proj's [r, w] and [d, r]: models/lora_experts.py); an adapter keeps each fused tensor's delta,
scaling B A per expert, so a forward adds it to the live weight (the base may be updated between). The
experts of a forward see its tokens flattened, row after row: a request's rows are its tokens' blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from bapo_megatron.models.lora import PEFT_PREFIX
from bapo_megatron.models.lora_experts import interleaved

FUSED = ("gate_up_proj", "down_proj")
"""The fused expert tensors adapted, as PEFT's target_parameters name them under `mlp.experts.`."""
TARGET_PARAMETERS = frozenset(f"mlp.experts.{p}" for p in FUSED)
"""The adapter_config.json target_parameters this engine serves: both, together."""
_NAME = re.compile(
    rf"{re.escape(PEFT_PREFIX)}(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\."
    rf"(?P<proj>{'|'.join(FUSED)})\.lora_(?P<matrix>[AB])\.weight"
)

Deltas = dict[str, dict[str, torch.Tensor]]
"""{experts module: {fused tensor: scaling x B A, [E, out, in]}}."""


def is_expert_tensor(name: object) -> bool:
    """Whether a received tensor's name is a routed expert's adapter matrix."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def expert_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The served model's fused expert modules by name (a 3-D gate_up_proj and down_proj each)."""
    return {
        name: m
        for name, m in model.named_modules()
        if all(isinstance(getattr(m, p, None), torch.nn.Parameter) and getattr(m, p).dim() == 3 for p in FUSED)
    }


def build_deltas(
    modules: Mapping[str, torch.nn.Module], r: int, scaling: float, tensors: Iterable[tuple[str, torch.Tensor]]
) -> Deltas:
    """Every expert module's deltas from the per-expert tensors; ValueError naming the first tensor that
    does not fit, or the first matrix missing (every expert of every module, both fused tensors)."""
    found: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _NAME.fullmatch(name)
        module, proj, matrix, expert = match["module"], match["proj"], match["matrix"], int(match["expert"])
        if module not in modules:
            raise ValueError(f"{name}: the served model has no fused experts {module}")
        experts, out, inp = _shape(modules[module], proj)
        want = (r, inp) if matrix == "A" else (out, r)
        if expert >= experts or tuple(tensor.shape) != want:
            raise ValueError(f"{name}: expert {expert} of {experts}, shape {tuple(tensor.shape)}, expected {want}")
        if not tensor.dtype.is_floating_point or not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name}: must be finite floating point values")
        found.setdefault((module, proj, matrix), {})[expert] = tensor
    deltas: Deltas = {}
    for module, experts_module in modules.items():
        for proj in FUSED:
            weight = getattr(experts_module, proj)
            a, b = (_stacked(found, module, proj, m, weight.shape[0]) for m in "AB")
            if proj == "gate_up_proj" and not getattr(experts_module, "is_concatenated", True):
                b = torch.stack([interleaved(e) for e in b])  # the sent B is [gate; up]
            delta = scaling * torch.bmm(b.float(), a.float())
            if getattr(experts_module, "is_transposed", False):
                delta = delta.transpose(1, 2)
            deltas.setdefault(module, {})[proj] = delta.to(weight.dtype)
    return deltas


def _shape(module: torch.nn.Module, proj: str) -> tuple[int, int, int]:
    """(experts, out, in) of fused tensor `proj` of an experts module, whichever way it holds them."""
    experts, first, second = getattr(module, proj).shape
    return (experts, second, first) if getattr(module, "is_transposed", False) else (experts, first, second)


def _stacked(found: dict, module: str, proj: str, matrix: str, experts: int) -> torch.Tensor:
    by_expert = found.get((module, proj, matrix), {})
    missing = next((e for e in range(experts) if e not in by_expert), None)
    if missing is not None:
        raise ValueError(f"{PEFT_PREFIX}{module}.{missing}.{proj}.lora_{matrix}.weight: missing (target_parameters)")
    return torch.stack([by_expert[e] for e in range(experts)])


def adapted(module: torch.nn.Module, deltas: Mapping[str, torch.Tensor], args: tuple) -> torch.Tensor:
    """The experts' output on `args` with each fused tensor W + its delta (the module's own forward)."""
    weights = {proj: getattr(module, proj) + delta for proj, delta in deltas.items()}
    return torch.func.functional_call(module, weights, args)


def expert_hook(served, name: str):
    """The forward hook of experts module `name` that runs each active adapter's rows (ServedAdapters'
    `_active`, `_batch`) with its deltas, the other rows as the base ran them."""
    inside = []  # the adapted run calls the module again, hooks and all: that call is left alone

    def run_adapters(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if inside:
            return None
        inside.append(True)
        try:
            return _with_adapters(served, name, module, args, output)
        finally:
            inside.pop()

    return run_adapters


def _with_adapters(
    served, name: str, module: torch.nn.Module, args: tuple, output: torch.Tensor
) -> torch.Tensor | None:
    out = None
    for adapter, rows in served._active:
        deltas = adapter.experts.get(name)
        if deltas is None:
            continue
        if rows is None:
            out = adapted(module, deltas, args)
            continue
        tokens = args[0].shape[0]
        if tokens % served._batch:
            raise RuntimeError(f"{name}: {tokens} tokens are not the forward's {served._batch} rows' blocks")
        per_row = tokens // served._batch
        picked = (rows[:, None] * per_row + torch.arange(per_row)).flatten()
        part = adapted(module, deltas, tuple(a[picked] for a in args))
        out = (output if out is None else out).index_copy(0, picked, part.to(output.dtype))
    return out
