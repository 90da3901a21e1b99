"""LoRA on DeepSeek-V3's multi-latent attention (models/mla.py latent_lora_targets): names, shapes and
counts against PEFT's on transformers' model, with and without a query latent; the merge against PEFT's
merge_and_unload (rope_interleave false: the rotary rows Megatron interleaves); the replicated
down-projections whole on every TP rank; what SGLang 0.5.23's LoRA loader serves from the wheel.
Megatron's layers against PEFT and TP 2: tests/dist/test_lora_families.py."""

import dataclasses

import pytest
import torch

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.lora import (
    adapter_names,
    adapter_params,
    check_targets,
    layer_targets,
    peft_config,
)
from bapo_megatron.models.spec import tiny_spec
from tests.lora_peft import assert_merge_is_pefts, peft_model, peft_shapes

LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _no_query_latent():
    """Moonlight's attention (no query latent), its rotary rows as halves (rope_interleave false)."""
    spec = tiny_spec("deepseek_v3")
    latent = dataclasses.replace(spec.latent_attention, q_lora_rank=None, rope_interleave=False)
    return dataclasses.replace(spec, latent_attention=latent, moe=None)


@pytest.fixture(scope="module", params=["query-latent", "no-query-latent"])
def latent(request):
    """A tiny DeepSeek-V3 spec and a random transformers model of it."""
    from tests.families import random_hf_model

    spec = tiny_spec("deepseek_v3") if request.param == "query-latent" else _no_query_latent()
    return spec, random_hf_model(spec)


def test_names_shapes_and_counts_are_pefts(latent):
    spec, model = latent
    lora = LoRAConfig(rank=4, sync="merged")
    theirs = peft_shapes(peft_model(model, spec, lora))
    assert set(adapter_names(spec, lora).values()) == set(theirs)
    query = ("q_proj",) if spec.latent_attention.q_lora_rank is None else ("q_a_proj", "q_b_proj")
    assert {n.split(".")[-3] for n in theirs} == {*query, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    assert adapter_params(spec, lora, list(range(spec.num_layers)), 1) == sum(s.numel() for s in theirs.values())


def test_the_merge_is_pefts_merge_and_unload(latent):
    """Each adapter merged into its latent projection where PEFT's merge puts it: with rope_interleave
    false, q_proj's and kv_a_proj_with_mqa's rotary rows in Megatron's interleaved order."""

    spec, model = latent
    lora = LoRAConfig(rank=4, alpha=8.0, sync="merged")
    assert_merge_is_pefts(spec, model, lora)


def test_down_projections_are_whole_on_every_tp_rank():
    targets = {t.name: t for t in layer_targets(tiny_spec("deepseek_v3"), LoRAConfig(rank=4), 1)}
    for name in ("q_a_proj", "kv_a_proj_with_mqa"):
        t = targets[name]
        assert t.split_dim("A") is None and t.split_dim("B") is None and t.params(4, 2) == t.params(4, 1)
    assert targets["q_b_proj"].split_dim("B") == 0 and targets["kv_b_proj"].split_dim("B") == 0
    assert targets["o_proj"].split_dim("A") == 1


def test_adapter_sync_sends_what_sglang_serves():
    """With a query latent SGLang serves every latent projection, the two down-projections together
    only (its fused_qkv_a_proj_with_mqa); without one neither q_proj nor kv_a_proj_with_mqa: all-linear
    leaves them out under adapter sync, naming one is refused there, sync merged trains them. The MLPs
    are no target (peft reads them as the routed experts' fused tensors)."""
    spec, plain = tiny_spec("deepseek_v3"), _no_query_latent()
    assert {t.name for t in layer_targets(spec, LoRAConfig(rank=4), 0)} == set(LATENT)
    assert {t.name for t in layer_targets(plain, LoRAConfig(rank=4), 0)} == {"kv_b_proj", "o_proj"}
    merged = {t.name for t in layer_targets(plain, LoRAConfig(rank=4, sync="merged"), 0)}
    assert merged == {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
    with pytest.raises(ConfigError, match=r"\['q_a_proj'\].*only beside \['kv_a_proj_with_mqa'\].*sync=merged"):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("q_a_proj", "o_proj")))
    check_targets(spec, LoRAConfig(rank=4, target_modules=("q_a_proj", "kv_a_proj_with_mqa")))
    with pytest.raises(ConfigError, match=r"\['q_proj'\].*deepseek_v3.*sync=merged"):
        check_targets(plain, LoRAConfig(rank=4, target_modules=("q_proj",)))
    check_targets(plain, LoRAConfig(rank=4, target_modules=("q_proj",), sync="merged"))
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules=\['gate_proj'\].*deepseek_v3"):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("gate_proj",)))


def _sglang_reads(ns, spec, lora, tmp_path) -> dict[str, torch.Tensor]:
    """SGLang's LoRAAdapter's normalised tensors of layer 1 of our adapter (PEFT's names and config)."""
    import json

    import transformers
    from safetensors.torch import save_file

    from bapo_megatron.models.lora import PEFT_CONFIG, PEFT_WEIGHTS, megatron_name

    shapes = {}
    for i in range(spec.num_layers):
        for t in layer_targets(spec, lora, i):
            shapes[megatron_name(i, t, "A")], shapes[megatron_name(i, t, "B")] = (4, t.in_features), (t.out_features, 4)
    names = adapter_names(spec, lora)
    tensors = {names[k]: torch.randn(s) for k, s in shapes.items()}
    save_file(tensors, str(tmp_path / PEFT_WEIGHTS))
    (tmp_path / PEFT_CONFIG).write_text(json.dumps(peft_config(spec, lora, None)))
    base = transformers.AutoConfig.for_model(**spec.to_hf_config())
    adapter = ns["LoRAAdapter"]("ours", ns["LoRAConfig"](str(tmp_path)), base, None, None)
    adapter.initialize_weights_from_tensors(tensors)
    return adapter.layers[1].weights, tensors, base


def test_sglang_serves_what_adapter_sync_sends(wheel, monkeypatch, tmp_path):
    """Our all-linear adapter under sync adapter read by SGLang 0.5.23's LoRA loader (from the wheel):
    the two down-projections stacked into fused_qkv_a_proj_with_mqa ([A_q; A_kv], [B_q; B_kv]), every
    tensor of the buffer shape its default get_hidden_dim and get_stacked_multiply give (DeepSeek's
    model defines none)."""
    from tests.unit.test_peft_sglang_loader import _sglang

    ns = _sglang(wheel, monkeypatch)
    spec, lora = tiny_spec("deepseek_v3"), LoRAConfig(rank=4)
    weights, ours, base = _sglang_reads(ns, spec, lora, tmp_path)
    targets = ns["get_normalized_target_modules"](peft_config(spec, lora, None)["target_modules"])
    assert targets == {"fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"}
    for name, weight in weights.items():
        module = ns["get_target_module_name"](name, targets)
        inputs, outputs = ns["get_default_hidden_dim"](module, base, 1)
        stacked = ns["get_stacked_multiply"](module)
        assert tuple(weight.shape) == ((4 * stacked, inputs) if "lora_A" in name else (outputs, 4)), name
    p = "base_model.model.model.layers.1.self_attn."
    fused = weights[p + "fused_qkv_a_proj_with_mqa.lora_B.weight"]
    assert torch.equal(
        fused, torch.cat([ours[p + "q_a_proj.lora_B.weight"], ours[p + "kv_a_proj_with_mqa.lora_B.weight"]])
    )


def test_sglang_cannot_serve_what_adapter_sync_refuses(wheel, monkeypatch, tmp_path):
    """Without a query latent SGLang stacks a q_proj adapter with k_proj and v_proj ones it lacks
    (KeyError), and files kv_a_proj_with_mqa under no module of that model; with one, q_a_proj alone
    is stacked with a kv part of its own shape, not the buffer's."""
    from tests.unit.test_peft_sglang_loader import _sglang

    ns = _sglang(wheel, monkeypatch)
    merged = LoRAConfig(rank=4, sync="merged", target_modules=("q_proj",))
    with pytest.raises(KeyError):
        _sglang_reads(ns, _no_query_latent(), merged, tmp_path)
    targets = ns["get_normalized_target_modules"](["kv_a_proj_with_mqa"])
    with pytest.raises(ValueError, match="Cannot find target module"):
        ns["get_target_module_name"]("model.layers.1.self_attn.kv_a_proj_with_mqa.lora_A.weight", targets)
    spec = tiny_spec("deepseek_v3")
    alone = LoRAConfig(rank=4, sync="merged", target_modules=("q_a_proj",))
    weights, _, base = _sglang_reads(ns, spec, alone, tmp_path)
    fused = weights["base_model.model.model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.lora_B.weight"]
    assert fused.shape[0] != ns["get_default_hidden_dim"]("fused_qkv_a_proj_with_mqa", base, 1)[1]
