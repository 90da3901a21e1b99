"""LoRA in the memory estimate: the adapters' activations (trainer/memory/adapters.py) against a hand
count of what their forward keeps, through the per-layer figure and the stage's (recompute and
pipeline as the estimate models them); a KL loss under LoRA counts no reference copy, and the dry
run says what the reference is. What the adapters really keep, measured on CPU, is
tests/unit/test_lora_reference.py's."""

import dataclasses

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.trainer.memory.estimate import activation_bytes, layer_activation_bytes, trainer_memory

SPEC = dataclasses.replace(tiny_spec("qwen2"), num_layers=8)
D, FFN = SPEC.hidden_size, SPEC.ffn_hidden_size


def _cfg(*overrides: str, lora: LoRAConfig | None = None):
    cfg = load_config(None, ["model.precision=bf16", *overrides])
    if lora is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora))
    return cfg


def _extra(lora: LoRAConfig, *overrides: str, spec=SPEC, layer: int = 0, local: bool = False) -> int:
    """layer_activation_bytes (or the local implementation's) with `lora` less without it."""
    from bapo_megatron.trainer.memory.estimate import local_layer_bytes

    per_layer = local_layer_bytes if local else layer_activation_bytes
    plain, adapted = _cfg(*overrides), _cfg(*overrides, lora=lora)
    return per_layer(spec, adapted.model, adapted.parallel, layer) - per_layer(spec, plain.model, plain.parallel, layer)


def test_all_linear_keeps_each_projections_rank_r_intermediate():
    # q, k, v, o, gate, up, down: one [tokens, r] h each, bf16; the inputs are the layers' own
    assert _extra(LoRAConfig(rank=8)) == 7 * 8 * 2
    # at TP 2 without sequence parallel h is still whole on every rank (A x is all-reduced / replicated)
    assert _extra(LoRAConfig(rank=8), "parallel.tensor=2") == 7 * 8 * 2


def test_sequence_parallel_gathers_the_rank_r_intermediate_not_the_input():
    # q/k/v and gate/up adapters run A on the rank's share of the sequence (the share the layer's count
    # holds) and gather h: no hidden-wide gathered input (it cost 2 * D / 2 * 2 bytes more a token)
    sp = ("parallel.tensor=2", "parallel.sequence_parallel=true")
    assert _extra(LoRAConfig(rank=8), *sp) == 7 * 8 * 2


def test_dropout_keeps_the_dropped_input_and_its_mask():
    lora = LoRAConfig(rank=4, dropout=0.1, target_modules=("q_proj", "v_proj", "down_proj"))
    sp = ("parallel.tensor=2", "parallel.sequence_parallel=true")
    # q and v share the fused layer's adapter input: one dropped copy (bf16) and a byte mask, of the
    # rank's half of the sequence under sequence parallel, whole without; down_proj's input is the
    # rank's half of the MLP's width
    assert _extra(lora, *sp) == 3 * 4 * 2 + D // 2 * (2 + 1) + FFN // 2 * (2 + 1)
    assert _extra(lora, "parallel.tensor=2") == 3 * 4 * 2 + D * (2 + 1) + FFN // 2 * (2 + 1)
    # the CPU's dropout keeps a noise tensor as wide as the input
    assert _extra(lora, *sp, local=True) == 3 * 4 * 2 + D // 2 * (2 + 2) + FFN // 2 * (2 + 2)


def test_a_moe_layer_adapts_its_attention_only():
    spec = tiny_spec("qwen3_moe")  # layer 0 dense, 1-3 sparse
    assert _extra(LoRAConfig(rank=8), spec=spec, layer=0) == 7 * 8 * 2
    assert _extra(LoRAConfig(rank=8), spec=spec, layer=1) == 4 * 8 * 2


@pytest.mark.parametrize(
    ("overrides", "copies"),
    [
        ((), 8),  # every layer of the stage keeps its adapters' h for the micro-batch
        (("parallel.recompute=selective",), 8),  # core attention only: the adapters as without
        (("parallel.pipeline=2",), 2 * 4),  # stage 0 of 1F1B holds two micro-batches of its 4 layers
        # inputs only, one layer rebuilt whole at a time (stage 0: no logits phase to peak instead)
        (("parallel.pipeline=2", "parallel.recompute=full"), 1),
    ],
)
def test_the_stage_counts_them_as_it_counts_the_layers(overrides, copies):
    tokens, lora = 1024, LoRAConfig(rank=16)
    plain, adapted = _cfg(*overrides), _cfg(*overrides, lora=lora)
    got = activation_bytes(SPEC, adapted.model, adapted.parallel, tokens, 0)
    want = activation_bytes(SPEC, plain.model, plain.parallel, tokens, 0) + copies * tokens * 7 * 16 * 2
    assert got == want


def test_a_kl_loss_under_lora_counts_no_reference_copy():
    from bapo_megatron import cli

    lora = LoRAConfig(rank=8)
    cfg = _cfg("algo.kl_coef=0.001", lora=lora)
    with_kl = trainer_memory(SPEC, cfg.model, cfg.parallel, 1, reference=True)
    without = trainer_memory(SPEC, cfg.model, cfg.parallel, 1)
    assert with_kl.reference == 0 and with_kl.peak == without.peak
    text = cli.dry_run(load_config(None, ["algo.kl_coef=0.001", "model.lora.rank=8"]), 1, 80 * cli.GIB)
    assert "KL loss (algo.kl_coef): reference: base with adapters off" in text
    assert "the reference model," not in text
    full = _cfg("algo.kl_coef=0.001")
    assert trainer_memory(SPEC, full.model, full.parallel, 1, reference=True).reference > 0
