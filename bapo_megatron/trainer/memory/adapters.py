"""What LoRA's adapters keep for backward beside their layer, per token of a micro-batch (model.lora).

The activation estimate (trainer/memory/estimate.py) counts a layer as full fine-tuning keeps it and
adds this. An adapter (trainer/lora.py) computes h = A dropout(x), then B h:
  - h, [tokens, rank] for each adapted projection (q, k and v of a fused q/k/v layer each their
    own), is kept for B's gradient: whole on every TP rank and for every token, sequence parallel
    or not (a column-parallel layer's h is the same on every rank; a row-parallel one's is all-reduced);
  - the input x is kept for A's gradient. Without dropout it is the layer's own input, which full
    fine-tuning's count holds already (kept by the adapter now: a frozen base linear keeps none,
    Megatron's linear_with_frozen_weight); under sequence parallel a column adapter's A runs on the
    rank's share of the sequence, the share the base kept (only h is gathered);
  - with dropout (model.lora.dropout > 0), the dropped input instead, and dropout's mask: one byte
    an element on the GPU (native_dropout); the local implementation's estimate, held to the CPU,
    counts the CPU's full-width noise tensor (its dropout multiplies by one; a GPU keeps less).
So this is an upper bound: the frozen base keeps less than full fine-tuning (no input of its linears
but those the adapters keep, with dropout not even those; the norms' inputs for their weights'
gradients). Measured on the tiny Qwen2 in fp32 (tests/unit/test_lora_reference.py), a layer with
rank-4 all-linear adapters keeps 6,137 bytes a token, full fine-tuning 6,667, to which this adds 112.
Not counted either: the column adapters' concatenated A, saved once a micro-batch (kilobytes).
A routed expert's adapters (model.lora.experts; never dropout) keep their h for the tokens routed to
the expert: per token, top_k experts' two (gate_up_proj's and down_proj's), each [rank], on the
rank that holds the expert (counted whole on every rank: routing may send a rank every copy); their
input is the expert's own, which full fine-tuning's count of the experts holds.
"""

from __future__ import annotations

from bapo_megatron.config import ParallelConfig
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.lora import Target, layer_targets
from bapo_megatron.models.lora_experts import is_expert_module
from bapo_megatron.models.spec import ModelSpec


def adapter_token_bytes(
    spec: ModelSpec, lora: LoRAConfig, parallel: ParallelConfig, layer: int, width: int, local: bool
) -> int:
    """What the adapters of 0-based layer `layer` keep for backward per token of a micro-batch, on one
    rank (0 with LoRA off); `width`: the activations' bytes an element (the parameters' dtype);
    `local`: the local implementation's (CPU) dropout."""
    if not lora.enabled:
        return 0
    tp, mask = parallel.tensor, width if local else 1
    by_module: dict[str, list[Target]] = {}
    routed = 0  # the routed experts' adapters: each holds h of its tokens, top_k / experts of them
    for target in layer_targets(spec, lora, layer):
        if is_expert_module(target.module):
            routed += 1
        else:
            by_module.setdefault(target.module, []).append(target)
    total = routed * spec.moe.top_k * lora.rank * width // spec.moe.num_experts if routed else 0
    for targets in by_module.values():
        total += len(targets) * lora.rank * width  # h: each projection's rank-r intermediate
        column = targets[0].parallel != "row"  # a replicated layer's input is a column one's
        whole = column and not parallel.sequence_parallel  # else a share: of the sequence, or of the features
        features = targets[0].in_features if whole else targets[0].in_features // tp
        if lora.dropout > 0:
            total += features * (width + mask)
    return total
