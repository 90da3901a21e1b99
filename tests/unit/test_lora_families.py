"""LoRA targets beyond the standard decoder, each family's own (Family.lora_targets): Qwen3.5's gated
full attention and Gated DeltaNet projections, Qwen3.5-MoE's shared expert; their names, shapes and
parameter counts against PEFT's on the transformers model, the merge against PEFT's merge_and_unload,
what SGLang serves under adapter sync.
Megatron's layers against PEFT and TP 2: tests/dist/test_lora_families.py."""

import pytest
import torch

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.lora import (
    adapter_names,
    adapter_params,
    check_targets,
    layer_targets,
    megatron_name,
    merge_adapters,
)
from bapo_megatron.models.lora import peft_config as peft_config_of
from bapo_megatron.models.spec import tiny_spec
from tests.lora_peft import assert_merge_is_pefts, peft_model, peft_shapes

HYBRIDS = ("qwen3_5_text", "qwen3_5_moe_text")
DELTA_RULE_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request):
    """A tiny hybrid's spec and a random transformers model of it."""
    from tests.families import random_hf_model

    spec = tiny_spec(request.param)
    return spec, random_hf_model(spec)


def test_names_shapes_and_counts_are_pefts(hybrid):
    spec, model = hybrid
    lora = LoRAConfig(rank=4, sync="merged")
    theirs = peft_shapes(peft_model(model, spec, lora))
    names = adapter_names(spec, lora)
    assert set(names.values()) == set(theirs)
    assert any("linear_attn.in_proj_qkv" in n for n in theirs) and any("self_attn.q_proj" in n for n in theirs)
    if spec.moe is not None:
        assert any("mlp.shared_expert.gate_proj" in n for n in theirs)
    assert adapter_params(spec, lora, list(range(spec.num_layers)), 1) == sum(s.numel() for s in theirs.values())


def test_the_merge_is_pefts_merge_and_unload(hybrid):
    """The gated q_proj's rows (each head's query and gate, held apart by Megatron) and the delta rule's
    fused in_proj take each adapter where PEFT's merge puts it."""

    spec, model = hybrid
    lora = LoRAConfig(rank=4, alpha=8.0, sync="merged")
    assert_merge_is_pefts(spec, model, lora)


def test_adapter_sync_sends_what_sglang_serves():
    """SGLang 0.5.23's Qwen3.5 serves no adapter of the delta rule's input projections from PEFT's
    tensors: all-linear leaves them out under adapter sync, naming one is refused by name there, and
    sync merged trains them."""
    spec = tiny_spec("qwen3_5_text")
    linear = spec.linear_attention.layers[0]
    served = {t.name for t in layer_targets(spec, LoRAConfig(rank=4), linear)}
    assert served == {"out_proj", "gate_proj", "up_proj", "down_proj"}
    merged = {t.name for t in layer_targets(spec, LoRAConfig(rank=4, sync="merged"), linear)}
    assert merged == served | set(DELTA_RULE_INPUTS)
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules=\['in_proj_z'\].*qwen3_5_text.*sync=merged"):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("q_proj", "in_proj_z")))
    check_targets(spec, LoRAConfig(rank=4, target_modules=("q_proj", "in_proj_z"), sync="merged"))


def test_a_tp_rank_holds_in_proj_qkv_whole_and_the_rest_split():
    """in_proj_qkv's rows are three parts Megatron splits over TP each on its own: no slice of B is a
    rank's, so B is whole on every rank; the other column targets split B, row targets A."""
    spec = tiny_spec("qwen3_5_text")
    targets = {t.name: t for t in layer_targets(spec, LoRAConfig(rank=4, sync="merged"), 0)}
    qkv = targets["in_proj_qkv"]
    assert qkv.split_dim("B") is None and qkv.params(4, 2) == qkv.params(4, 1)
    assert targets["in_proj_z"].split_dim("B") == 0 and targets["out_proj"].split_dim("A") == 1
    full = {t.name: t for t in layer_targets(spec, LoRAConfig(rank=4), 3)}
    assert full["q_proj"].out_features == 2 * spec.num_heads * spec.head_dim  # queries and output gates


def test_routed_experts_are_refused_naming_the_family(monkeypatch):
    from bapo_megatron.models import family_of

    monkeypatch.setattr(type(family_of("gpt_oss")), "lora_experts", False)  # a family whose experts are not built
    with pytest.raises(ConfigError, match=r"model\.lora\.experts.*gpt_oss.*not built"):
        check_targets(tiny_spec("gpt_oss"), LoRAConfig(rank=4, experts=True))


def test_a_base_stored_part_by_part_is_merged_as_the_whole():
    """A dist checkpoint stores Gated DeltaNet's in_proj as its parts (in_proj.weight.query, ...): the
    merge (convert_checkpoint --merge-lora reads it so) gives the parts of the whole's merge."""
    from bapo_megatron.models.qwen3_5 import IN_PROJ_PARTS, gdn_widths

    spec = tiny_spec("qwen3_5_text")
    lora = LoRAConfig(rank=4, sync="merged", target_modules=("in_proj_qkv", "in_proj_b"))
    g = torch.Generator().manual_seed(2)
    qk, v, heads = gdn_widths(spec)
    base = "decoder.layers.0.self_attention.in_proj.weight"
    whole = {base: torch.randn(2 * qk + 2 * v + 2 * heads, spec.hidden_size, generator=g)}
    for t in layer_targets(spec, lora, 0):
        whole[megatron_name(0, t, "A")] = torch.randn(4, t.in_features, generator=g)
        whole[megatron_name(0, t, "B")] = torch.randn(t.out_features, 4, generator=g)
    sizes = (qk, qk, v, v, heads, heads)
    parts = {k: t for k, t in whole.items() if k != base}
    parts |= {f"{base}.{p}": t for p, t in zip(IN_PROJ_PARTS, whole[base].split(sizes), strict=True)}
    want = merge_adapters(spec, whole, 2.0)[base]
    got = merge_adapters(spec, parts, 2.0)
    assert not torch.equal(want, whole[base])
    assert torch.equal(torch.cat([got[f"{base}.{p}"] for p in IN_PROJ_PARTS]), want) and base not in got


@pytest.mark.parametrize("arch", ["glm4_moe", "gpt_oss"])
def test_attention_only_families_adapt_it_as_peft_does(arch):
    """GLM-4.5's and gpt-oss's q/k/v (with biases) and o of every layer; an MLP target is refused by name."""
    import peft

    from tests.families import random_hf_model

    spec, lora = tiny_spec(arch), LoRAConfig(rank=4)
    config = peft.LoraConfig(r=4, target_modules=peft_config_of(spec, lora, None)["target_modules"])
    model = peft.get_peft_model(random_hf_model(spec), config)
    theirs = {n.replace(".default.", "."): p.shape for n, p in model.named_parameters() if p.requires_grad}
    assert set(adapter_names(spec, lora).values()) == set(theirs)
    assert adapter_params(spec, lora, list(range(spec.num_layers)), 1) == sum(s.numel() for s in theirs.values())
    with pytest.raises(ConfigError, match=rf"model\.lora\.target_modules=\['gate_proj'\].*{arch}"):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("q_proj", "gate_proj")))


def _qwen3_5_lora_model(wheel) -> tuple[list[str], object]:
    """SGLang 0.5.23's Qwen3_5ForCausalLM: its supported_lora_modules and get_hidden_dim (from the wheel)."""
    import ast

    from tests.sglang_wheel import load_defs, source

    text = source(wheel, "models/qwen3_5.py")
    body = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "Qwen3_5ForCausalLM")
    listed = next(n for n in body.body if isinstance(n, ast.Assign) and n.targets[0].id == "supported_lora_modules")
    moe_types = next(
        n
        for n in ast.parse(text).body
        if isinstance(n, ast.Assign) and n.targets[0].id == "_QWEN3_5_MOE_TEXT_MODEL_TYPES"
    )
    ns = {"_QWEN3_5_MOE_TEXT_MODEL_TYPES": ast.literal_eval(moe_types.value)}
    ns = load_defs(wheel, {"models/qwen3_5.py": ["Qwen3_5ForCausalLM.get_hidden_dim"]}, ns)
    return ast.literal_eval(listed.value), ns["get_hidden_dim"]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_sglang_serves_what_adapter_sync_sends(arch, wheel, monkeypatch, tmp_path):
    """Our adapter of a Qwen3.5 model under sync "adapter" (all-linear) read by SGLang 0.5.23's LoRA
    loader from the wheel: every tensor filed under a module its Qwen3.5 serves, with that module's
    buffer shape (its get_hidden_dim); the delta-rule input projections sync "merged" adds normalise
    to no module SGLang knows (why they are refused under adapter sync)."""
    import json
    import types

    import transformers
    from safetensors.torch import save_file

    from bapo_megatron.models.lora import PEFT_CONFIG, PEFT_WEIGHTS
    from tests.unit.test_peft_sglang_loader import _sglang

    ns = _sglang(wheel, monkeypatch)
    supported, hidden_dim = _qwen3_5_lora_model(wheel)
    spec, lora = tiny_spec(arch), LoRAConfig(rank=4)
    shapes = {}
    for i in range(spec.num_layers):
        for t in layer_targets(spec, lora, i):
            shapes[megatron_name(i, t, "A")], shapes[megatron_name(i, t, "B")] = (4, t.in_features), (t.out_features, 4)
    names = adapter_names(spec, lora)
    save_file({names[k]: torch.zeros(s) for k, s in shapes.items()}, str(tmp_path / PEFT_WEIGHTS))
    (tmp_path / PEFT_CONFIG).write_text(json.dumps(peft_config_of(spec, lora, None)))
    base = transformers.AutoConfig.for_model(**spec.to_hf_config())
    config = ns["LoRAConfig"](str(tmp_path))
    adapter = ns["LoRAAdapter"]("ours", config, base, None, None)
    adapter.initialize_weights_from_tensors({p: torch.zeros(shapes[m]) for m, p in names.items()})
    targets = ns["get_normalized_target_modules"](config.target_modules)
    model = types.SimpleNamespace(config=base)
    served = 0
    for i, layer in enumerate(adapter.layers):
        for name, weight in layer.weights.items():
            module = ns["get_target_module_name"](name, targets)
            assert module in supported, (name, module)
            inputs, outputs = hidden_dim(model, module, i)
            stacked = ns["get_stacked_multiply"](module)
            assert tuple(weight.shape) == ((4 * stacked, inputs) if "lora_A" in name else (outputs, 4)), name
            served += 1
    assert served and "in_proj_qkvz" not in targets
    merged = peft_config_of(spec, LoRAConfig(rank=4, sync="merged"), None)["target_modules"]
    extra = ns["get_normalized_target_modules"](merged) - targets
    assert extra == set(DELTA_RULE_INPUTS) and not extra & set(supported)


LORA_FAMILIES = (
    "qwen2",
    "llama",
    "qwen3",
    "qwen3_moe",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_next",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
)


@pytest.mark.parametrize("arch", LORA_FAMILIES)
def test_servers_are_launched_for_the_modules_the_adapters_hold(arch, wheel, monkeypatch):
    """The server's --lora-target-modules under sync "adapter" (all-linear): the adapted projections by
    name, never SGLang's "all" (it gives every linear it finds a buffer and fails on one it cannot
    adapt: Qwen3-Next's in_proj_qkvz), normalised by SGLang 0.5.23's own function to the modules the
    adapter's PEFT config names (and with model.lora.experts the experts' gate_up_proj and down_proj)."""
    from bapo_megatron.config import RolloutConfig
    from bapo_megatron.engines.sglang_launcher import ServedLoRA, lora_args
    from tests.unit.test_peft_sglang_loader import _sglang

    normalise = _sglang(wheel, monkeypatch)["get_normalized_target_modules"]
    spec = tiny_spec(arch)
    for lora in [LoRAConfig(rank=4)] + ([LoRAConfig(rank=4, experts=True)] if arch == "qwen3_moe" else []):
        launched = lora_args(RolloutConfig(), ServedLoRA.of(spec, lora))["lora-target-modules"]
        assert "all" not in launched and launched
        sent = normalise(peft_config_of(spec, lora, None)["target_modules"])
        experts = {"gate_up_proj", "down_proj"} if lora.experts else set()
        assert normalise(launched) == sent | experts, (arch, launched)
    assert ServedLoRA.of(spec, LoRAConfig(rank=4, sync="merged")) is None
