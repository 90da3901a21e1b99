"""DeepSeek-V3 (DeepseekV3ForCausalLM: multi-latent attention, routed experts) through the family checks
(tests/families.py): transformers' logits and routes with and without a query latent, YaRN and plain
RoPE, both rope_interleave layouts; conversion both ways; TP 2 (sequence parallel), PP 2 and EP 2
equal to one process. The exported names through SGLang's DeepSeek loader (models/deepseek_v2.py
serves V3); DeepSeek-V3's, Moonlight's and Kimi-K2's config.json shapes read into the spec, what is
not mapped refused by name."""

import dataclasses
import json

import pytest
import torch

from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from bapo_megatron.trainer.memory.estimate import layer_params
from tests.families import FamilyCase, SGLangLoader, check_family, check_sglang_names

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "ep_size": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}
"""deepseek-ai/DeepSeek-V3's config.json (its auto_map and fp8 quantization_config left out)."""
MOONLIGHT = DEEPSEEK_V3 | {
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 2.446,
    "q_lora_rank": None,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 50000.0,
    "rope_scaling": None,
}
"""moonshotai/Moonlight-16B-A3B's shape: queries without a latent, plain RoPE, groups that limit nothing."""
KIMI_K2 = DEEPSEEK_V3 | {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "routed_scaling_factor": 2.827,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"factor": 32.0, "beta_fast": 1.0},
}
"""moonshotai/Kimi-K2-Instruct's shape (its model_type is kimi_k2)."""
DROP = object()
"""A key left out of a config.json."""


def _variants() -> tuple[ModelSpec, ...]:
    """The tiny model's attention without a query latent (and with rotary halves, rope_interleave
    false), with plain RoPE, every layer dense, and with Moonlight's rms_norm_eps 1e-5."""
    tiny = tiny_spec("deepseek_v3")
    mla = tiny.latent_attention
    no_latent = dataclasses.replace(mla, q_lora_rank=None, rope_interleave=False)
    return (
        dataclasses.replace(tiny, latent_attention=no_latent),
        dataclasses.replace(tiny, moe=None, latent_attention=dataclasses.replace(mla, yarn=None)),
        dataclasses.replace(tiny, rms_norm_eps=1e-5),
    )


def sglang_latent_eps(model) -> None:
    """SGLang's latent norms (deepseek_v2.py: q_a_layernorm, kv_a_layernorm) take config.json's
    rms_norm_eps, as the trainer's do; transformers fixes theirs at 1e-6: the reference made SGLang's."""
    for layer in model.model.layers:
        for norm in (getattr(layer.self_attn, "q_a_layernorm", None), layer.self_attn.kv_a_layernorm):
            if norm is not None:
                norm.variance_epsilon = model.config.rms_norm_eps


def test_deepseek_v3_family(tmp_path):
    case = FamilyCase("deepseek_v3", sglang=SGLANG, variants=_variants(), hf_convention=sglang_latent_eps)
    check_family(tmp_path, case)


def test_the_embedded_engine_says_its_latent_norms_differ(tmp_path):
    """transformers (the embedded engine) fixes the latent norms' epsilon at 1e-6 where the trainer and
    SGLang take rms_norm_eps: one warning when the engine serves a model whose rms_norm_eps is not 1e-6."""
    import warnings

    from bapo_megatron.engines.embedded.core import EngineCore
    from tests.families import random_hf_model, save_hf_model

    spec = dataclasses.replace(tiny_spec("deepseek_v3"), moe=None)
    save_hf_model(random_hf_model(spec), spec, tmp_path)
    for eps, said in ((1e-6, 0), (1e-5, 1)):
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps(config | {"rms_norm_eps": eps}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            EngineCore(tmp_path, max_batch=1)
        latent = [str(w.message) for w in caught if "latent norms" in str(w.message)]
        assert len(latent) == said and all("rms_norm_eps=1e-05" in m for m in latent), latent


# -- SGLang


def test_names_are_what_sglangs_loader_maps():
    """The tiny model's HF names and its variants' (what their exports write: the family test checks the
    export's names are the HF checkpoint's) through SGLang's DeepSeek loader, the query latent's
    down-projections fused, none without one."""
    from bapo_megatron.common.hf_io import expected_shapes
    from tests.families import sglang_param

    for spec in (tiny_spec("deepseek_v3"), *_variants()):
        check_sglang_names(SGLANG, expected_shapes(spec), spec)
    fused = list(fused_down_projections(tiny_spec("deepseek_v3")))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert sglang_param(name, fused, []) == "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight"
    assert not fused_down_projections(_variants()[0])


SGLANG_LOADER = "models/deepseek_common/deepseek_weight_loader.py"
SGLANG_RULES = (
    'if ("mlp.experts." in name) and name not in params_dict:',
    "num_experts=self.config.n_routed_experts + self.num_fused_shared_experts",
    'fuse_qkv_a_proj = hasattr(self.config, "q_lora_rank") and (',
    '"q_a_proj", "fused_qkv_a_proj_with_mqa"',
    '"fused_qkv_a_proj_with_mqa",',
    ">= self.config.num_hidden_layers",
)


def fused_down_projections(spec: ModelSpec) -> tuple[tuple[str, str, object], ...]:
    """The query and kv down-projections SGLang's DeepSeek loader fuses into fused_qkv_a_proj_with_mqa
    where queries have a latent (fuse_qkv_a_proj)."""
    if spec.latent_attention.q_lora_rank is None:
        return ()
    fused = "self_attn.fused_qkv_a_proj_with_mqa."
    return tuple((fused, f"self_attn.{down}.", i) for i, down in enumerate(("q_a_proj", "kv_a_proj_with_mqa")))


SGLANG = SGLangLoader(
    SGLANG_LOADER,
    sources=("models/deepseek_v2.py",),
    stacked=fused_down_projections,
    rules=tuple((SGLANG_LOADER, rule) for rule in SGLANG_RULES),
)
"""SGLang's DeepSeek loader (deepseek_common/deepseek_weight_loader.py, the rules the replay relies on
checked in its source): gate and up projections stacked (the experts' skipped), the experts through
FusedMoE, the latent down-projections fused; the modules deepseek_v2.py's classes assign."""


# -- config.json


def _total(spec: ModelSpec) -> int:
    layers = sum(sum(layer_params(spec, i).__dict__.values()) for i in range(spec.num_layers))
    return layers + 2 * spec.vocab_size * spec.hidden_size + spec.hidden_size


def test_deepseek_v3_config_is_read_as_its_shape():
    spec = ModelSpec.from_hf_config(DEEPSEEK_V3)
    mla, moe = spec.latent_attention, spec.moe
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, spec.head_dim, spec.num_kv_heads) == (
        1536,
        512,
        192,
        192,
        128,
    )
    assert (mla.yarn.factor, mla.yarn.mscale, mla.yarn.mscale_all_dim, mla.rope_interleave) == (40.0, 1.0, 1.0, True)
    assert moe.sparse_layers == tuple(range(3, 61)) and (moe.num_groups, moe.group_top_k) == (8, 4)
    assert (moe.scaling_factor, moe.shared_ffn_hidden_size, moe.expert_bias) == (2.5, 2048, True)
    fields = family_of(spec).transformer_fields(spec)
    assert (fields["rope_type"], fields["rotary_scaling_factor"], fields["mscale"]) == ("yarn", 40.0, 1.0)
    assert (fields["qk_head_dim"], fields["qk_pos_emb_head_dim"], fields["moe_router_bias_update_rate"]) == (
        128,
        64,
        0.0,
    )
    assert 670e9 < _total(spec) < 672e9  # DeepSeek-V3: 671B parameters without its MTP layer


def test_moonlight_and_kimi_k2_configs_are_read():
    moonlight = ModelSpec.from_hf_config(MOONLIGHT)
    assert moonlight.latent_attention.q_lora_rank is None and moonlight.latent_attention.yarn is None
    assert moonlight.moe.num_groups is None and moonlight.moe.shared_ffn_hidden_size == 2 * 1408
    assert family_of(moonlight).transformer_fields(moonlight)["rope_type"] == "rope"
    assert 15.5e9 < _total(moonlight) < 16.5e9  # Moonlight-16B-A3B
    with pytest.raises(BadInputError, match="kimi_k2"):
        ModelSpec.from_hf_config(KIMI_K2)
    kimi = ModelSpec.from_hf_config(KIMI_K2 | {"model_type": "deepseek_v3"})
    assert kimi.latent_attention.yarn.beta_fast == 1.0 and kimi.moe.num_experts == 384
    assert 1.02e12 < _total(kimi) < 1.05e12  # Kimi-K2: 1.04T parameters


def test_the_spec_writes_back_a_config_transformers_reads():
    import transformers

    for spec in (tiny_spec("deepseek_v3"), *_variants()):
        config = transformers.AutoConfig.for_model(**spec.to_hf_config()).to_dict()
        assert ModelSpec.from_hf_config(config) == spec


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 16}, "num_key_value_heads"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"attention_factor": 1.2}}, "attention_factor"),
        ({"rope_scaling": DEEPSEEK_V3["rope_scaling"] | {"truncate": False}}, "truncate"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "group_limited_greedy"}, "topk_method"),
        ({"n_group": 8, "topk_group": 2}, "topk_group"),  # top-8 from 2 groups: Megatron scores groups otherwise
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"kv_lora_rank": DROP}, "kv_lora_rank"),
        # DeepseekV3Config's defaults (1536, 2.5, 8, 4) are DeepSeek-V3's own: a config.json must state them
        ({"q_lora_rank": DROP}, "q_lora_rank"),
        ({"routed_scaling_factor": DROP}, "routed_scaling_factor"),
        ({"n_group": DROP}, "n_group"),
        ({"topk_group": DROP}, "topk_group"),
        ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, "activation_scheme"),
    ],
)
def test_what_is_not_mapped_is_refused_by_name(change, field):
    config = {k: v for k, v in (DEEPSEEK_V3 | change).items() if v is not DROP}
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_config(config)


def test_transformer_engine_names_are_read_from_a_layer():
    """Transformer Engine's MLA keeps the input norm a module of its own (input_layernorm, the local
    spec's name) and fuses the latent norms into the up-projections: a layer's spec is still read
    from its names (weights/layout.layer_impl), and the names map back to HF bitwise."""
    from bapo_megatron.weights.layout import hf_to_megatron, layer_impl, megatron_to_hf
    from tests.families import hf_state, random_hf_model

    spec = tiny_spec("deepseek_v3")
    hf = hf_state(random_hf_model(spec))
    for impl in ("transformer_engine", "local"):
        mg = hf_to_megatron(spec, hf, 256, impl)
        for i in range(spec.num_layers):
            assert layer_impl(n for n in mg if n.startswith(f"decoder.layers.{i}.")) == impl, (impl, i)
        assert ("decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in mg) == (impl != "local")
        back = megatron_to_hf(spec, mg, impl)
        assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_layouts_and_engine_cache_of_latent_attention():
    """Tensor parallel needs sequence parallel (Megatron's MLA gradients are wrong without it, refused
    before anything is built); SGLang caches a token's kv latent and rotary key, on every TP rank."""
    from bapo_megatron.models.spec import check_layout

    dense = dataclasses.replace(tiny_spec("deepseek_v3"), moe=None)
    check_layout(dense, 2, 1, sequence_parallel=True)
    with pytest.raises(ConfigError, match="sequence_parallel"):
        check_layout(dense, 2, 1, sequence_parallel=False)
    spec = ModelSpec.from_hf_config(DEEPSEEK_V3)
    assert family_of(spec).engine_cache_bytes(spec, 8) == 61 * (512 + 64) * 2


def test_mla_is_built_without_te_or_cuda_only_while_it_is_built():
    """The names models/mla.py swaps while Megatron's MLA is built (a scoped patch, for megatron-core
    0.16.1) are still Megatron's, and are theirs again afterwards."""
    from types import SimpleNamespace

    from megatron.core.transformer import multi_latent_attention as mla

    from bapo_megatron.models.mla import _buildable_without_te_or_cuda

    before = mla.HAVE_TE, mla.YarnRotaryEmbedding, mla.TELinear
    with _buildable_without_te_or_cuda(SimpleNamespace(use_cpu_initialization=True)):
        assert not mla.HAVE_TE or isinstance(mla.TELinear, type)
        assert mla.YarnRotaryEmbedding.keywords == {"use_cpu_initialization": True}
    assert (mla.HAVE_TE, mla.YarnRotaryEmbedding, mla.TELinear) == before
