"""model.lora: its checks, the family's targets and names (against PEFT's own on the transformers
model), the adapters' parameter count per TP rank, and the memory estimate with the base frozen.
The Megatron layers against PEFT and across layouts: tests/dist/test_lora_layouts.py."""

import dataclasses

import pytest
import torch

from bapo_megatron.config import load_config
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.lora import adapter_names, adapter_params, check_targets, is_adapter, layer_targets
from bapo_megatron.models.spec import tiny_spec


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("model.lora.rank=-1", "model.lora.rank"),
        ("model.lora.alpha=0", "model.lora.alpha"),
        ("model.lora.dropout=1.0", "model.lora.dropout"),
        ("model.lora.target_modules=[q_proj,q_proj]", "model.lora.target_modules"),
        ("model.lora.target_modules=[all-linear,q_proj]", "model.lora.target_modules"),
        ("model.lora.init=pissa", "model.lora.init"),
    ],
)
def test_bad_settings_are_refused_with_their_name(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, [override])


def test_transformer_engine_with_lora_is_refused_until_built():
    with pytest.raises(ConfigError, match=r"model\.lora\.rank=8.*local"):
        load_config(None, ["model.lora.rank=8", "model.transformer_impl=transformer_engine"])
    assert load_config(None, ["model.transformer_impl=transformer_engine"]).model.lora.rank == 0


def test_unknown_targets_are_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules=\['qkv_proj'\].*'q_proj'.*'down_proj'"):
        check_targets(tiny_spec("qwen2"), LoRAConfig(rank=4, target_modules=("q_proj", "qkv_proj")))
    with pytest.raises(ConfigError, match=r"model\.lora\.experts.*no routed experts"):
        check_targets(tiny_spec("qwen3"), LoRAConfig(rank=4, experts=True))


def test_a_moe_model_adapts_attention_and_its_dense_layers_only():
    spec = tiny_spec("qwen3_moe")
    routed = [i for i in range(spec.num_layers) if spec.moe.is_sparse(i)]
    dense = [i for i in range(spec.num_layers) if not spec.moe.is_sparse(i)]
    assert routed and dense
    lora = LoRAConfig(rank=4)
    assert {t.name for i in routed for t in layer_targets(spec, lora, i)} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert all(len(layer_targets(spec, lora, i)) == 7 for i in dense)
    every = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, sparse_layers=tuple(range(spec.num_layers))))
    with pytest.raises(ConfigError, match=r"gate_proj.*experts"):  # names nothing anywhere: refused, not ignored
        check_targets(every, LoRAConfig(rank=4, target_modules=("gate_proj",)))
    check_targets(spec, LoRAConfig(rank=4, target_modules=("gate_proj",)))


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj", "down_proj")])
def test_names_and_shapes_are_pefts(targets):
    """Our map names every adapter PEFT makes on the transformers model, with its shape, and
    counts its parameters."""
    peft = pytest.importorskip("peft")
    import transformers

    spec = tiny_spec("qwen3")
    lora = LoRAConfig(rank=4, target_modules=targets)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**spec.to_hf_config()))
    config = peft.LoraConfig(r=4, target_modules=targets[0] if targets == ("all-linear",) else list(targets))
    model = peft.get_peft_model(hf, config)
    theirs = {n.replace(".default.", "."): p.shape for n, p in model.named_parameters() if p.requires_grad}
    names = adapter_names(spec, lora)
    assert set(names.values()) == set(theirs)
    assert all(is_adapter(n) for n in names) and not any(is_adapter(n) for n in dict(hf.named_parameters()))
    assert adapter_params(spec, lora, list(range(spec.num_layers)), 1) == sum(s.numel() for s in theirs.values())
    for layer in range(spec.num_layers):
        for t in layer_targets(spec, lora, layer):
            assert theirs[names[f"decoder.layers.{layer}.{t.module}_lora.{t.name}.lora_A.weight"]] == (4, t.in_features)
            assert theirs[names[f"decoder.layers.{layer}.{t.module}_lora.{t.name}.lora_B.weight"]] == (
                t.out_features,
                4,
            )


def test_a_tp_rank_holds_its_share():
    """Beside a column-parallel layer A is whole and B split; beside a row-parallel one A is split and B whole."""
    spec = tiny_spec("qwen2")
    d, q, kv, ffn, r = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, 128, 4
    column = r * d * 3 + (q + 2 * kv) * r // 2 + r * d * 2 + 2 * ffn * r // 2
    row = r * q // 2 + d * r + r * ffn // 2 + d * r
    assert adapter_params(spec, LoRAConfig(rank=r), [0], 2) == column + row
    assert adapter_params(spec, LoRAConfig(rank=0), [0], 2) == 0


def test_memory_counts_gradients_and_adam_for_the_adapters_only():
    from bapo_megatron.trainer.memory.estimate import stage_layers, stage_memory

    spec = dataclasses.replace(tiny_spec("qwen2"), num_layers=8)
    full = load_config(None, ["parallel.pipeline=2", "model.precision=fp32"])
    lora = dataclasses.replace(full, model=dataclasses.replace(full.model, lora=LoRAConfig(rank=8)))
    for stage in (0, 1):
        n = adapter_params(spec, lora.model.lora, stage_layers(8, 2, stage), 1)
        base = stage_memory(spec, full.model, full.parallel, 2, stage)
        got = stage_memory(spec, lora.model, lora.parallel, 2, stage)
        assert got.params == base.params + 4 * n
        assert got.grads == 4 * n < base.grads
        assert got.optimizer == 8 * n // 2  # Adam's two fp32 moments, split over 2 data-parallel ranks
        assert got.activations > base.activations  # the adapters' own: tests/unit/test_memory_lora.py


def test_peft_init_leaves_step_zero_at_the_base():
    """A kaiming-uniform with a = sqrt(5) (PEFT's default: bound 1 / sqrt(in)), B zero."""
    from bapo_megatron.models.lora import layer_targets as targets
    from bapo_megatron.trainer.lora import _initial

    spec = tiny_spec("qwen2")
    target = targets(spec, LoRAConfig(rank=8), 0)[0]
    a, b = _initial(target, LoRAConfig(rank=8), 0)
    bound = 1 / target.in_features**0.5
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and torch.count_nonzero(b) == 0
    again, _ = _initial(target, LoRAConfig(rank=8), 0)
    other, _ = _initial(target, LoRAConfig(rank=8), 1)
    assert torch.equal(a, again) and not torch.equal(a, other)
    gaussian, _ = _initial(target, LoRAConfig(rank=8, init="gaussian"), 0)
    assert abs(gaussian.std().item() - 1 / 8) < 0.02
