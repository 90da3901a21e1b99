"""LoRA on Qwen3-Next (models/qwen3_next.py): its gated attention and its delta rule's in_proj_qkvz /
in_proj_ba (HF's rows per key head, Megatron's in_proj part by part) and out_proj; names, shapes and
counts against PEFT's on transformers' model, the merge against PEFT's merge_and_unload, a TP rank's
rows of B, and what SGLang 0.5.23 serves of it (its Qwen3NextForCausalLM read from the wheel).
Megatron's layers against PEFT and TP 2: tests/dist/test_lora_families.py."""

import ast

import pytest
import torch

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.lora import adapter_names, adapter_params, check_targets, layer_targets
from bapo_megatron.models.spec import tiny_spec
from tests.lora_peft import assert_merge_is_pefts, peft_model, peft_shapes

DELTA_RULE = ("in_proj_qkvz", "in_proj_ba", "out_proj")


@pytest.fixture(scope="module")
def next_model():
    """The tiny Qwen3-Next's spec and a random transformers model of it."""
    from tests.families import random_hf_model

    spec = tiny_spec("qwen3_next")
    return spec, random_hf_model(spec)


def test_names_shapes_and_counts_are_pefts(next_model):
    spec, model = next_model
    lora = LoRAConfig(rank=4, sync="merged")
    theirs = peft_shapes(peft_model(model, spec, lora))
    assert set(adapter_names(spec, lora).values()) == set(theirs)
    assert {n.split(".")[-3] for n in theirs} == {"q_proj", "k_proj", "v_proj", "o_proj", *DELTA_RULE}
    assert adapter_params(spec, lora, list(range(spec.num_layers)), 1) == sum(s.numel() for s in theirs.values())


def test_the_merge_is_pefts_merge_and_unload(next_model):
    """Each grouped projection's adapter merged into Megatron's in_proj parts (q, k, v, z, b, a) where
    PEFT's merge puts it in HF's per-key-head rows (two key heads: the order matters)."""

    spec, model = next_model
    assert spec.linear_attention.num_key_heads > 1
    lora = LoRAConfig(rank=4, alpha=8.0, sync="merged", target_modules=DELTA_RULE)
    assert_merge_is_pefts(spec, model, lora)


def test_a_tp_rank_holds_its_key_heads_rows_of_b():
    """HF's rows of in_proj_qkvz / in_proj_ba are per key head, and Megatron splits every in_proj part
    over TP by key heads: a rank's rows of B are a slice (split, not whole as Qwen3.5's in_proj_qkv)."""
    from bapo_megatron.models.lora import slots

    spec = tiny_spec("qwen3_next")
    targets = {t.name: t for t in layer_targets(spec, LoRAConfig(rank=4, sync="merged"), 0)}
    assert targets["in_proj_qkvz"].split_dim("B") == 0 and targets["in_proj_ba"].split_dim("B") == 0
    la = spec.linear_attention
    ratio = la.num_value_heads // la.num_key_heads
    sizes = (la.key_head_dim, la.key_head_dim, ratio * la.value_head_dim, ratio * la.value_head_dim)
    y = torch.arange(la.num_key_heads * sum(sizes)).float()  # HF's rows: key head 0's q, k, v, z, then 1's
    layout = slots(spec, 0, "self_attention.in_proj", 1)
    parts = layout.reorder(y, "in_proj_qkvz").split([s * la.num_key_heads for s in sizes])
    for i, part in enumerate(parts):  # Megatron's: every head's q, then every head's k, ...
        heads = [y[h * sum(sizes) + sum(sizes[:i]) :][: sizes[i]] for h in range(la.num_key_heads)]
        assert torch.equal(part, torch.cat(heads))


def _sglang_qwen3_next(wheel) -> ast.ClassDef:
    from tests.sglang_wheel import source

    tree = ast.parse(source(wheel, "models/qwen3_next.py"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3NextForCausalLM")


def test_adapter_sync_sends_what_sglang_serves(wheel, monkeypatch):
    """SGLang 0.5.23's Qwen3NextForCausalLM defines no LoRA dimensions (get_hidden_dim) nor modules:
    the default refuses in_proj_qkvz and out_proj, knows no in_proj_ba, and its qkv_proj lacks the
    output gate's rows our q_proj has; o_proj it serves. All-linear under adapter sync is o_proj;
    naming another is refused there, sync merged trains them."""
    import transformers

    from tests.unit.test_peft_sglang_loader import _sglang

    cls = _sglang_qwen3_next(wheel).body
    body = {n.name for n in cls if isinstance(n, ast.FunctionDef)}
    body |= {t.id for n in cls if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert "packed_modules_mapping" in body  # the class read is the model's
    assert "get_hidden_dim" not in body and "supported_lora_modules" not in body
    ns = _sglang(wheel, monkeypatch)
    spec = tiny_spec("qwen3_next")
    base = transformers.AutoConfig.for_model(**spec.to_hf_config())
    for module in ("in_proj_qkvz", "out_proj", "in_proj_ba"):
        with pytest.raises(NotImplementedError):
            ns["get_default_hidden_dim"](module, base, 0)
    full = next(i for i in range(spec.num_layers) if i not in spec.linear_attention.layers)
    targets = {t.name: t for t in layer_targets(spec, LoRAConfig(rank=4, sync="merged"), full)}
    rows = sum(targets[n].out_features for n in ("q_proj", "k_proj", "v_proj"))
    assert ns["get_default_hidden_dim"]("qkv_proj", base, full)[1] != rows
    o = targets["o_proj"]
    assert ns["get_default_hidden_dim"]("o_proj", base, full) == (o.in_features, o.out_features)
    served = {t.name for i in range(spec.num_layers) for t in layer_targets(spec, LoRAConfig(rank=4), i)}
    assert served == {"o_proj"}
    with pytest.raises(ConfigError, match=r"\['in_proj_qkvz'\].*qwen3_next.*sync=merged"):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("o_proj", "in_proj_qkvz")))
    check_targets(spec, LoRAConfig(rank=4, target_modules=("o_proj", "in_proj_qkvz"), sync="merged"))
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules=\['gate_proj'\].*qwen3_next"):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("gate_proj",), sync="merged"))
