"""GLM-4.5/4.6 MoE (Glm4MoeForCausalLM) through the family checks (tests/families.py): transformers'
logits and routes, conversion both ways, TP 2, PP 2 and EP 2 equal to one process, SGLang's loader
names; and the real GLM-4.5-Air / GLM-4.5 config.json read into the spec, what is not mapped refused
by name."""

import dataclasses

import pytest

from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from bapo_megatron.trainer.memory.estimate import layer_params
from tests.families import FamilyCase, SGLangLoader, check_family

GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0",
    "use_cache": True,
    "use_qk_norm": False,
    "vocab_size": 151552,
}
"""zai-org/GLM-4.5-Air's config.json."""
GLM_45 = GLM_45_AIR | {
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 160,
    "num_hidden_layers": 92,
    "first_k_dense_replace": 3,
    "routed_scaling_factor": 2.5,
    "use_qk_norm": True,
}
"""zai-org/GLM-4.5's shape (GLM-4.6 is the same)."""


def test_glm4_moe_family(tmp_path):
    tiny = tiny_spec("glm4_moe")
    qk_norm = dataclasses.replace(tiny, qk_norm=True, qkv_bias=False)  # GLM-4.5's q/k norms, no biases
    check_family(tmp_path, FamilyCase("glm4_moe", sglang=SGLangLoader("models/glm4_moe.py"), variants=(qk_norm,)))


def test_glm_45_air_config_is_read_as_its_shape():
    spec = ModelSpec.from_hf_config(GLM_45_AIR)
    moe = spec.moe
    assert (spec.num_layers, spec.head_dim, spec.qkv_bias, spec.qk_norm, spec.rotary_fraction) == (
        46,
        128,
        True,
        False,
        0.5,
    )
    assert moe.sparse_layers == tuple(range(1, 46)) and (moe.num_experts, moe.top_k) == (128, 8)
    assert (moe.score_function, moe.expert_bias, moe.num_groups, moe.shared_ffn_hidden_size) == (
        "sigmoid",
        True,
        None,
        1408,
    )
    family = family_of(spec)
    fields = family.transformer_fields(spec)
    assert fields["moe_router_bias_update_rate"] == 0.0 and fields["moe_shared_expert_intermediate_size"] == 1408
    assert fields["moe_router_topk_scaling_factor"] is None and fields["add_qkv_bias"]
    total = sum(sum(layer_params(spec, i).__dict__.values()) for i in range(spec.num_layers))
    total += 2 * spec.vocab_size * spec.hidden_size + spec.hidden_size
    assert 106e9 < total < 107e9  # GLM-4.5-Air: 106B parameters (without its MTP layer)
    full = ModelSpec.from_hf_config(GLM_45)
    assert full.qk_norm and full.moe.scaling_factor == 2.5 and full.moe.sparse_layers[0] == 3
    assert family.transformer_fields(full)["qk_layernorm"] and family.normed_qk_width(full) > 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n_group": 8, "topk_group": 2}, "topk_group"),  # top-8 from 2 of 8 groups: Megatron scores groups otherwise
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"first_k_dense_replace": 46}, "first_k_dense_replace"),
        ({"n_group": 3, "topk_group": 1}, "n_group"),
        # one sigmoid score: transformers divides it by itself (1), Megatron keeps it
        ({"num_experts_per_tok": 1}, "norm_topk_prob"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method='awq'"),
        # fp8 is read with block scales only (models/quantized.py)
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.weight_block_size=None"),
    ],
)
def test_what_is_not_mapped_is_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_config(GLM_45_AIR | change)


def test_a_single_sigmoid_expert_is_mapped_unnormalised():
    """top-1 sigmoid routing: Megatron weighs the expert by its score, as transformers does without
    norm_topk_prob."""
    spec = ModelSpec.from_hf_config(GLM_45_AIR | {"num_experts_per_tok": 1, "norm_topk_prob": False})
    assert spec.moe.top_k == 1 and not spec.moe.norm_topk_prob


def test_deepseek_style_groups_are_mapped():
    """n_group 8, topk_group 4, top-8 (DeepSeek-V3's ratio, 2): Megatron's groups."""
    spec = ModelSpec.from_hf_config(GLM_45_AIR | {"n_group": 8, "topk_group": 4})
    fields = family_of(spec).transformer_fields(spec)
    assert (fields["moe_router_num_groups"], fields["moe_router_group_topk"]) == (8, 4)


def test_the_shared_expert_counts_as_dense_compute_and_activations():
    """The memory estimate and the recompute cost count the shared expert as a dense MLP split over TP
    (its parameters as `tensor`, its activations in every routed layer); a TP that does not divide its
    width is refused by name."""
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import check_layout
    from bapo_megatron.trainer.memory.estimate import layer_activation_bytes

    cfg = load_config(None, [])
    spec = tiny_spec("glm4_moe")
    alone = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, shared_ffn_hidden_size=0))
    width = spec.moe.shared_ffn_hidden_size
    assert layer_params(spec, 1).tensor - layer_params(alone, 1).tensor == 3 * spec.hidden_size * width
    assert layer_activation_bytes(spec, cfg.model, cfg.parallel, 1) > layer_activation_bytes(
        alone, cfg.model, cfg.parallel, 1
    )
    odd = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, shared_ffn_hidden_size=33))
    with pytest.raises(ConfigError, match="shared expert's width 33"):
        check_layout(odd, 2, 1)
