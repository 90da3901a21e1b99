"""LoRA on the routed experts (model.lora.experts, models/lora_experts.py): the adapters' names, shapes
and counts against PEFT's on transformers 5's Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, GLM-4.5 and
DeepSeek-V3 (their fused expert tensors, gate_up_proj [E, 2w, d] and down_proj [E, d, w] alike) and
gpt-oss ([E, d, 2w] and [E, w, d], gate and up interleaved), by target_parameters,
the merge against PEFT's merge_and_unload, the parameter count per expert-parallel rank, and the
refusals by name. Megatron's layers against PEFT and EP 2: tests/dist/test_lora_experts.py."""

import pytest
import torch

from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.lora import adapter_names, adapter_params, check_targets, merge_adapters, peft_config
from bapo_megatron.models.lora_experts import check_experts, interleaved, interleaves, peft_stacked, per_projection
from bapo_megatron.models.spec import tiny_spec

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = {
    "qwen3_moe": ATTENTION,
    # gated attention, the delta rule's output and the shared expert beside the routed experts
    "qwen3_5_moe_text": ("q_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("o_proj", "in_proj_qkvz", "out_proj"),  # its delta rule's grouped projections
    "glm4_moe": ATTENTION,
    "deepseek_v3": ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj"),  # its latent attention
    "gpt_oss": ATTENTION,
}
"""Each family whose routed experts LoRA adapts, with the modules adapted beside them."""
SYNC = {"qwen3_next": "merged"}
"""The families whose expert adapters SGLang does not serve: trained under sync merged."""


def _config(spec, targets, **kwargs) -> LoRAConfig:
    return LoRAConfig(
        rank=4, target_modules=targets, experts=True, sync=SYNC.get(spec.architecture, "adapter"), **kwargs
    )


@pytest.fixture(scope="module", params=list(TARGETS))
def moe(request):
    """A tiny MoE family's spec, a random transformers model of it and its target modules."""
    from tests.families import random_hf_model

    spec = tiny_spec(request.param)
    return spec, random_hf_model(spec), TARGETS[request.param]


def _peft(model, spec, lora):
    import copy

    import peft

    config = {
        k: v for k, v in peft_config(spec, lora, None).items() if k not in ("peft_type", "base_model_name_or_path")
    }
    return peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**config))


def _theirs(model) -> dict[str, torch.Size]:
    return {n.replace(".default.", "."): p.shape for n, p in model.named_parameters() if p.requires_grad}


def test_names_shapes_and_counts_are_pefts(moe):
    """Per expert our names are SGLang's keys; stacked (peft_stacked), they are PEFT's on the fused tensors.
    (Attention and experts: PEFT 0.21 on transformers 5 takes any gate_proj/up_proj/down_proj module of a
    Qwen3-MoE model, a dense layer's too, for the v4 experts' and moves it to the fused tensors.)"""
    spec, model, targets = moe
    lora = _config(spec, targets)
    names = adapter_names(spec, lora)
    experts = [n for n in names.values() if ".mlp.experts." in n]
    assert len(experts) == 2 * 2 * spec.moe.num_experts * len(spec.moe.sparse_layers)
    assert "base_model.model.model.layers.1.mlp.experts.3.gate_up_proj.lora_A.weight" in experts
    theirs = _theirs(_peft(model, spec, lora))
    shapes = {}
    for ours, peft_name in names.items():
        layer = int(ours.split(".")[2])
        target = next(t for t in _targets(spec, lora, layer) if f".{t.module}_lora.{t.name}." in ours)
        shapes[peft_name] = torch.zeros((4, target.in_features) if ".lora_A." in ours else (target.out_features, 4))
    stacked = peft_stacked(spec, shapes)
    assert {k: v.shape for k, v in stacked.items()} == theirs
    assert adapter_params(spec, lora, list(range(spec.num_layers)), 1) == sum(s.numel() for s in theirs.values())


def _hf_delta(spec, b, a):
    """Expert gate_up_proj's B A as transformers holds the tensor (PEFT's delta for it)."""
    if not interleaves(spec):
        return b @ a
    return (interleaved(b) @ a).T


def _targets(spec, lora, layer):
    from bapo_megatron.models.lora import layer_targets

    return layer_targets(spec, lora, layer)


def test_the_stacked_layout_is_pefts_delta_per_expert(moe):
    """PEFT's delta of expert e from our stacked matrices is expert e's scaling x B A, and the merge
    (merge_adapters, what the engines get under sync merged) is PEFT's merge_and_unload."""
    import peft

    from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf
    from tests.families import hf_state

    spec, model, targets = moe
    lora = _config(spec, targets, alpha=8.0)
    names = adapter_names(spec, lora)
    g = torch.Generator().manual_seed(1)
    adapters = {}
    for layer in range(spec.num_layers):
        for t in _targets(spec, lora, layer):
            adapters[f"decoder.layers.{layer}.{t.module}_lora.{t.name}.lora_A.weight"] = torch.randn(
                4, t.in_features, generator=g
            )
            adapters[f"decoder.layers.{layer}.{t.module}_lora.{t.name}.lora_B.weight"] = 0.1 * torch.randn(
                t.out_features, 4, generator=g
            )
    theirs = _peft(model, spec, lora)
    peft.set_peft_model_state_dict(theirs, peft_stacked(spec, {names[k]: v for k, v in adapters.items()}))
    wrapper = theirs.base_model.model.model.layers[2].mlp.experts.base_layer  # gate_up_proj's
    delta = wrapper.get_delta_weight("default")
    a = adapters["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1_lora.gate_up_proj.lora_A.weight"]
    b = adapters["decoder.layers.2.mlp.experts.local_experts.3.linear_fc1_lora.gate_up_proj.lora_B.weight"]
    torch.testing.assert_close(delta[3], _hf_delta(spec, 2.0 * b, a))
    reference = hf_state(theirs.merge_and_unload())
    hf = {k: v.detach().clone() for k, v in hf_state(model).items()}
    mg = {**hf_to_megatron(spec, hf, spec.vocab_size, "local"), **adapters}
    merged = megatron_to_hf(spec, merge_adapters(spec, mg, lora.alpha / lora.rank), "local")
    changed = {k for k in merged if not torch.equal(merged[k], hf[k])}
    assert any(".mlp.experts." in k for k in changed) and any(".self_attn." in k for k in changed)
    for k in merged:
        torch.testing.assert_close(merged[k], reference[k], rtol=1e-6, atol=1e-6, msg=k)
    found = {}  # the merge of an adapters-alone checkpoint onto a base on disk (weights/lora_merge.py)
    for ours, tensor in adapters.items():
        peft_name = names[ours]
        weight = peft_name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight"
        found.setdefault(weight, {})[peft_name[-8]] = tensor
    pairs = per_projection(spec, {w: (m["A"], m["B"]) for w, m in found.items()})
    assert set(pairs) == changed
    for w, (a, b) in pairs.items():
        torch.testing.assert_close(hf[w] + 2.0 * b @ a, reference[w], rtol=1e-6, atol=1e-6, msg=w)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_an_expert_parallel_rank_holds_its_experts_adapters(arch):
    spec = tiny_spec(arch)
    lora = _config(spec, TARGETS[arch])
    beside = LoRAConfig(rank=4, target_modules=TARGETS[arch], sync=lora.sync)
    layers = list(range(spec.num_layers))
    attention = adapter_params(spec, beside, layers, 2)
    experts = adapter_params(spec, lora, layers, 1) - adapter_params(spec, beside, layers, 1)
    per_expert = 4 * (spec.hidden_size + 2 * spec.moe.ffn_hidden_size) + 4 * (
        spec.moe.ffn_hidden_size + spec.hidden_size
    )
    assert experts == per_expert * spec.moe.num_experts * len(spec.moe.sparse_layers)
    assert adapter_params(spec, lora, layers, 2, ep=2) == attention + experts // 2  # experts whole: expert TP 1


def test_what_is_not_built_is_refused_by_name(monkeypatch):
    from bapo_megatron.models import family_of

    monkeypatch.setattr(type(family_of("gpt_oss")), "lora_experts", False)  # as if not built
    built = r"built for deepseek_v3, glm4_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next\)"
    with pytest.raises(ConfigError, match=rf"model\.lora\.experts.*gpt_oss is not built.*{built}"):
        check_targets(tiny_spec("gpt_oss"), LoRAConfig(rank=4, target_modules=("o_proj",), experts=True))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"model\.lora\.experts.*qwen3.*no routed experts"):
        check_targets(tiny_spec("qwen3"), LoRAConfig(rank=4, experts=True))
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout=0\.1.*PEFT"):
        check_targets(tiny_spec("qwen3_moe"), LoRAConfig(rank=4, dropout=0.1, experts=True))
    with pytest.raises(ConfigError, match=r"model\.moe\.grouped_gemm.*false"):
        check_experts(tiny_spec("qwen3_moe"), LoRAConfig(rank=4, experts=True), True, grouped=True)
    for arch, targets in TARGETS.items():
        check_targets(tiny_spec(arch), _config(tiny_spec(arch), targets))


def test_gpt_oss_experts_layout_is_the_one_the_adapters_follow():
    """transformers 5's GptOssExperts hold gate_up_proj as [E, d, 2w] (x @ W), gate and up columns
    interleaved, and PEFT 0.21 adapts it unswapped (in d, out 2w): its B rows are those interleaved
    columns, where Megatron's linear_fc1 and the per-expert B are [gate; up] (models/lora_experts.py)."""
    import peft

    from tests.families import random_hf_model

    spec = tiny_spec("gpt_oss")
    e, d, w = spec.moe.num_experts, spec.hidden_size, spec.moe.ffn_hidden_size
    model = random_hf_model(spec)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (e, d, 2 * w) and experts.is_transposed
    x = torch.randn(1, d)
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    gate = gate_up[..., ::2].clamp(max=experts.limit)
    up = gate_up[..., 1::2].clamp(-experts.limit, experts.limit)
    want = (up + 1) * gate * torch.sigmoid(gate * experts.alpha) @ experts.down_proj[0] + experts.down_proj_bias[0]
    routing = torch.zeros(1, e)
    routing[0, 0] = 1.0
    got = experts(x, torch.tensor([[0]]), routing)
    torch.testing.assert_close(got, want, msg="gate even columns, up odd")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"])
    wrapper = peft.get_peft_model(model, config).base_model.model.model.layers[0].mlp.experts
    assert (wrapper.in_features, wrapper.out_features) == (d, 2 * w) and not wrapper._did_swap_in_out_features


def test_qwen3_next_expert_adapters_are_refused_under_adapter_sync_by_sglangs_reason():
    """SGLang 0.5.23's Qwen3-Next sizes the shared expert's LoRA buffers by the dense MLP's width: its
    expert adapters are trained under sync merged, refused under sync adapter with the widths named,
    served where the two widths agree."""
    import dataclasses

    spec = tiny_spec("qwen3_next")
    assert spec.moe.shared_ffn_hidden_size != spec.ffn_hidden_size
    want = rf"model\.lora\.experts=True: SGLang.*intermediate_size {spec.ffn_hidden_size}, not its.*sync=merged"
    with pytest.raises(ConfigError, match=want):
        check_targets(spec, LoRAConfig(rank=4, target_modules=("o_proj",), experts=True))
    check_targets(spec, LoRAConfig(rank=4, target_modules=("o_proj",), experts=True, sync="merged"))
    same = dataclasses.replace(spec, ffn_hidden_size=spec.moe.shared_ffn_hidden_size)
    check_targets(same, LoRAConfig(rank=4, target_modules=("o_proj",), experts=True))


def test_the_activation_estimate_counts_each_routed_tokens_expert_adapters():
    """Per token, top_k experts keep two rank-r intermediates (gate_up_proj's and down_proj's)."""
    from bapo_megatron.config import ParallelConfig
    from bapo_megatron.trainer.memory.adapters import adapter_token_bytes

    spec, parallel = tiny_spec("qwen3_moe"), ParallelConfig()
    without = adapter_token_bytes(spec, LoRAConfig(rank=4, target_modules=ATTENTION), parallel, 1, 2, False)
    with_experts = adapter_token_bytes(
        spec, LoRAConfig(rank=4, target_modules=ATTENTION, experts=True), parallel, 1, 2, False
    )
    assert with_experts - without == spec.moe.top_k * 2 * 4 * 2


def test_a_dense_layers_mlp_adapter_that_peft_would_not_load_is_named():
    """peft 0.21 on transformers 5 reads Qwen3-MoE's gate_proj / up_proj / down_proj as its experts':
    the tiny model's dense first layer's MLP adapters are named (the PEFT export refuses them); the
    attention's, a dense family's and the routed experts' are not."""
    from bapo_megatron.models.lora import peft_unloadable

    spec = tiny_spec("qwen3_moe")
    assert not spec.moe.is_sparse(0) and all(spec.moe.is_sparse(i) for i in range(1, spec.num_layers))
    named = peft_unloadable(spec, LoRAConfig(rank=4))
    assert named == [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert peft_unloadable(spec, LoRAConfig(rank=4, target_modules=("q_proj", "o_proj"), experts=True)) == []
    assert peft_unloadable(tiny_spec("qwen3"), LoRAConfig(rank=4)) == []
