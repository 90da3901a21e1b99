"""LoRA adapters beside Megatron's column- and row-parallel linear layers, the base frozen.

    apply_lora(gpt, spec, model_cfg.lora)   # on a built GPTModel chunk (build_gpt_model does it)

An adapter adds (alpha / r) B A dropout(x) to its base layer's output through a forward hook on the
base, so the base's names, checkpoint keys and forward stay Megatron's. Which projections, their
names and their TP split are models/lora.py's. The split makes a TP step the one-process step:

- beside a column-parallel layer (q/k/v, gate/up): A whole on every rank, B split by rows as the base
  weight is. h = A x is the same on every rank, and its gradient is all-reduced, each rank holding
  B's rows for its part of the output: A's and x's gradients are then whole on every rank. Under
  sequence parallel A runs on the rank's share of the sequence and h (rank r, not the hidden width)
  is gathered; its gradient is reduce-scattered, and A's gradient summed over TP by Megatron.
- where the base splits a target's rows part by part (Qwen3.5's in_proj_qkv: query, key and value
  each split over TP), no slice of B is a rank's: B is whole on every rank, which takes its parts'
  rows; B's gradient, each rank's for its rows, is summed over TP in the backward.
- beside a row-parallel layer (o, down): A split by columns as the base weight is, B whole; the
  partial A x of every rank is all-reduced, B's output is the whole one (scattered over the sequence
  under sequence parallel, as the base's output is).
- beside a replicated layer (multi-latent attention's down-projections, whole on every rank): A and
  B whole; under sequence parallel each rank's gradients are its sequence share's, summed over TP by
  Megatron as the base weight's would be.

Only the adapters require a gradient: Megatron's DDP makes gradient buffers, and its optimizer
state, for those parameters alone.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.lora import SUFFIX, check_targets, is_adapter, layer_targets, megatron_rows, slots
from bapo_megatron.models.lora import megatron_name as adapter_name
from bapo_megatron.models.lora_experts import check_experts, is_expert_module, local_module
from bapo_megatron.models.lora_targets import Slots, Target
from bapo_megatron.models.spec import ModelSpec


class Adapter(torch.nn.Module):
    """One projection's lora_A ([r, in]) and lora_B ([out, r]), as one TP rank holds them."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.lora_A = torch.nn.Module()
        self.lora_A.weight = torch.nn.Parameter(a)
        self.lora_B = torch.nn.Module()
        self.lora_B.weight = torch.nn.Parameter(b)


class LinearAdapters(torch.nn.ModuleDict):
    """The adapters of one Megatron linear layer by target name (several where the layer fuses
    projections), added to its output by `hook`."""

    def __init__(self, base: torch.nn.Module, targets: tuple[Target, ...], lora: LoRAConfig, layout: Slots | None):
        super().__init__()
        self.parallel = targets[0].parallel
        self.layout = layout
        self.targets = {t.name: t for t in targets}
        self.scaling = lora.alpha / lora.rank  # PEFT's lora_alpha / r
        self.rank = lora.rank
        self.dropout = lora.dropout
        self.tp_group = base.tp_group
        self.sequence_parallel = sequence_share(base)
        self.active = True
        """Whether the adapters add their delta (adapters_off: the base alone)."""

    def hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        if not self.active:
            return output
        out, bias = output
        return out + self.delta(args[0]).to(out.dtype), bias

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "replicated":
            return self._replicated(x)
        return self._column(x) if self.parallel == "column" else self._row(x)

    def _replicated(self, x: torch.Tensor) -> torch.Tensor:
        """A replicated layer's adapter: whole, on whatever share of the sequence the layer is given."""
        ((name, adapter),) = self.items()
        h = F.linear(self._dropout(x, split=self.sequence_parallel), adapter.lora_A.weight)
        y = F.linear(h, adapter.lora_B.weight) * self.scaling
        return megatron_rows(y, self.layout, name)

    def _column(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        names = list(self.keys())
        a = torch.cat([self[n].lora_A.weight for n in names])  # one collective for all targets
        if self.sequence_parallel:
            # A on this rank's share of the sequence, then the rank-r h gathered (r / hidden of the
            # traffic and memory of gathering x): h's gradient comes back summed over the ranks' B
            # rows and split (reduce-scatter), A's, a share of the sequence's, is summed over TP by
            # Megatron as a sequence-parallel norm's is (the attribute set in _mark_split)
            h = F.linear(self._dropout(x, split=True), a)
            h = mappings.gather_from_sequence_parallel_region(h, True, self.tp_group)
        else:
            h = F.linear(self._dropout(x, split=False), a)
            h = mappings.copy_to_tensor_model_parallel_region(h, self.tp_group)
        by_name = dict(zip(names, h.split(self.rank, dim=-1), strict=True))
        lead, groups = h.shape[:-1], self.layout.groups
        pieces = []
        for name, width in self.layout.parts:
            if name in by_name:
                y = F.linear(by_name[name], self._rank_rows(name)) * self.scaling
                pieces.append(megatron_rows(y, self.layout, name).view(*lead, groups, width))
            else:
                pieces.append(h.new_zeros(*lead, groups, width))
        return torch.cat(pieces, dim=-1).flatten(-2)  # (not reshape: an expert may get no tokens)

    def _rank_rows(self, name: str) -> torch.Tensor:
        """This TP rank's rows of target `name`'s B: B itself where B is split, else (B whole, its
        output split part by part: Target.parts) each part's share, B's gradient summed over TP."""
        from megatron.core.tensor_parallel import mappings

        b, parts = self[name].lora_B.weight, self.targets[name].parts
        if not parts:
            return b
        tp, rank = self.tp_group.size(), self.tp_group.rank()
        b = mappings.copy_to_tensor_model_parallel_region(b, self.tp_group)  # each rank's rows' gradient
        pieces = b.split(list(parts))
        return torch.cat([p.chunk(tp)[rank] for p in pieces])

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        (adapter,) = self.values()
        h = F.linear(self._dropout(x, split=True), adapter.lora_A.weight)
        h = mappings.reduce_from_tensor_model_parallel_region(h, self.tp_group)
        y = F.linear(h, adapter.lora_B.weight) * self.scaling
        if self.sequence_parallel:
            y = mappings.scatter_to_sequence_parallel_region(y, self.tp_group)
        return y

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """Dropout on the adapters' input. A whole input takes the same mask on every TP rank (so A
        and its gradient stay the same everywhere), a split one a mask of its own: from Megatron's
        data-parallel (same on TP ranks) and model-parallel (one per TP rank) generators, which the
        layers may already run inside a fork of (sequence parallel) and which activation recompute
        restores. (On the CPU, where the shim makes them the CPU generator's states, Megatron warns
        that the CPU state changed within the fork: it is the state it forked.)"""
        if not self.training or self.dropout == 0:
            return x
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork("model-parallel-rng" if split else "data-parallel-rng"):
            return F.dropout(x, self.dropout)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Dist checkpoint entries: the split matrices sharded over TP as the base weight is, the
        others replicated; each data-parallel rank's a replica of its own (the first writes), as
        Megatron's layers mark theirs from the metadata's dp_cp_group."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        axes = {
            f"{name}.lora_{m}.weight": dim
            for name, target in self.targets.items()
            for m in ("A", "B")
            if (dim := target.split_dim(m)) is not None
        }
        state = self.state_dict(prefix="", keep_vars=True)
        dp_cp = ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]
        return make_sharded_tensors_for_checkpoint(
            state, prefix, axes, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp
        )


def apply_lora(gpt: torch.nn.Module, spec: ModelSpec, lora: LoRAConfig) -> None:
    """Adapters on `gpt`'s layers (a GPTModel chunk: its global layer numbers), every other parameter
    frozen; nothing with LoRA off."""
    if not lora.enabled:
        return
    check_targets(spec, lora)
    for layer in gpt.decoder.layers:
        _adapt_layer(layer, spec, lora)
    for name, param in gpt.named_parameters():
        param.requires_grad_(is_adapter(name))
    if getattr(gpt, "pre_process", False):
        # Below the first adapter nothing requires a gradient: a recomputed (checkpointed) block of
        # layers whose input does not require one would give its adapters none.
        gpt.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))


def _adapt_layer(layer: torch.nn.Module, spec: ModelSpec, lora: LoRAConfig) -> None:
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    index = layer.layer_number - 1
    by_module: dict[str, list[Target]] = {}
    for target in layer_targets(spec, lora, index):
        by_module.setdefault(target.module, []).append(target)
    for module, targets in by_module.items():
        if is_expert_module(module):  # a routed expert's: on the expert-parallel rank that holds it
            module = local_expert_module(layer, spec, lora, module)
            if module is None:
                continue
        parent_name, _, base_name = module.rpartition(".")
        parent = layer.get_submodule(parent_name)
        base = getattr(parent, base_name)
        kind = {"column": ColumnParallelLinear, "row": RowParallelLinear, "replicated": Linear}[targets[0].parallel]
        if type(base) is not kind:
            raise TypeError(f"layer {index}'s {module} is a {type(base).__name__}, not Megatron's {kind.__name__}")
        tp, tp_rank = base.tp_group.size(), base.tp_group.rank()
        layout = slots(spec, index, module, tp) if targets[0].parallel != "row" else None
        adapters = LinearAdapters(base, tuple(targets), lora, layout)
        weight = base.weight
        for target in targets:
            a, b = _initial(target, lora, index)
            adapters[target.name] = Adapter(
                _shard(a, target.split_dim("A"), tp, tp_rank).to(weight),
                _shard(b, target.split_dim("B"), tp, tp_rank).to(weight),
            )
            _mark_split(adapters[target.name], target, sequence_share(base))
            if is_expert_module(targets[0].module):
                _mark_expert(adapters[target.name], weight)
        setattr(parent, base_name + SUFFIX, adapters)
        base.register_forward_hook(adapters.hook)


def local_expert_module(layer: torch.nn.Module, spec: ModelSpec, lora: LoRAConfig, module: str) -> str | None:
    """Expert module `module` (global number) by its name on this rank, None where another expert-parallel
    rank holds it; ConfigError for experts that are not run one after another (grouped GEMM)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = layer.mlp.experts
    if not isinstance(experts, SequentialMLP):
        check_experts(spec, lora, True, grouped=True)
    return local_module(experts, module)


def _initial(target: Target, lora: LoRAConfig, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole (TP = 1) A and B as PEFT initialises them: the same on every rank and at every layout
    (drawn from the run's seed and the adapter's name, not from RNG state the layout consumed)."""
    seed = (torch.initial_seed() + zlib.crc32(adapter_name(layer, target, "A").encode())) % 2**63
    generator = torch.Generator().manual_seed(seed)
    a = torch.empty(lora.rank, target.in_features)
    if lora.init == "kaiming":
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    else:
        torch.nn.init.normal_(a, std=1 / lora.rank, generator=generator)
    return a, torch.zeros(target.out_features, lora.rank)


def _shard(whole: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    return whole if dim is None else whole.chunk(tp, dim=dim)[rank].contiguous()


def _mark_split(adapter: Adapter, target: Target, sequence_parallel: bool) -> None:
    """Megatron's tensor-parallel attributes on the split matrix: the gradient norm counts it on every
    TP rank, a whole one on the first only; under sequence parallel a column adapter's A is marked as
    Megatron marks a norm's weight there, so its gradient is summed over TP."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for matrix in ("A", "B"):
        dim = target.split_dim(matrix)
        if dim is not None:
            set_tensor_model_parallel_attributes(getattr(adapter, f"lora_{matrix}").weight, True, dim, 1)
    if target.parallel == "column" and sequence_parallel:
        adapter.lora_A.weight.sequence_parallel = True  # each rank's gradient is its sequence share's
    if target.parallel == "replicated" and sequence_parallel:  # A's and B's: as the base weight's
        adapter.lora_A.weight.sequence_parallel = adapter.lora_B.weight.sequence_parallel = True


def _mark_expert(adapter: Adapter, weight: torch.Tensor) -> None:
    """A routed expert's adapters marked as its weight is: each expert-TP rank's own (whole at expert
    TP 1, counted by the gradient norm on every TP rank) and reduced over the expert data-parallel
    ranks, not over expert parallel (`allreduce`: Megatron's DDP and optimizer read it)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for matrix, dim in (("A", 1), ("B", 0)):
        param = getattr(adapter, f"lora_{matrix}").weight
        if not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, dim, 1)
        param.allreduce = getattr(weight, "allreduce", True)


def sequence_share(base: torch.nn.Module) -> bool:
    """Whether the base layer runs on this rank's share of the sequence: Megatron's parallel layers
    say so; a replicated one (models/mla.py's down-projections) is given the share under sequence
    parallel (its weight marked, its gradient summed over TP, as a norm's)."""
    if hasattr(base, "sequence_parallel"):
        return base.sequence_parallel
    return base.config.sequence_parallel


@contextlib.contextmanager
def adapters_off(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """The base model alone inside the block: every adapter of `chunks` adds nothing (a LoRA run's KL
    reference, NeMo-RL's and verl's: the base is the starting policy, so no second copy is kept).
    Nothing changes the parameters: the same forward as a model built without adapters. (A pipeline
    stage may hold none: a MoE model's MLP-only targets on a stage of sparse layers.)"""
    adapters = [m for chunk in chunks for m in chunk.modules() if isinstance(m, LinearAdapters)]
    for m in adapters:
        m.active = False
    try:
        yield
    finally:
        for m in adapters:
            m.active = True


def adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The adapters of a chunk by their (chunk-local) names."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


def lora_scaling(module: torch.nn.Module) -> float | None:
    """The adapters' alpha / rank in `module` (a layer or a model chunk); None: it has no adapters."""
    return next((m.scaling for m in module.modules() if isinstance(m, LinearAdapters)), None)
