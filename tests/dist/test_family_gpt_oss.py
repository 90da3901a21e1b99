"""gpt-oss (GptOssForCausalLM) through the family checks (tests/families.py): transformers' logits and
routes (sinks, sliding windows, YaRN unrounded and rounded, the clamped SwiGLU, biases everywhere),
conversion both ways, TP 2 with sequence parallel, PP 2 and EP 2 equal to one process after a BAPO
step; the export's names through SGLang's gpt_oss loader (its fused-expert mapping); a packed row's
samples kept apart by the sliding-window layers; gpt-oss-20b's config.json read into its shape, what
is not mapped refused by name (the MXFP4 release is read: tests/unit/test_quantized_releases.py)."""

import dataclasses
import re
import zipfile

import pytest
import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.features import SlidingWindowSpec
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from bapo_megatron.trainer.memory.estimate import layer_params
from tests.dist.launch import run_workers
from tests.families import FamilyCase, assigned_modules, check_family, stacked_params_mapping

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}
"""openai/gpt-oss-20b's config.json, bf16 (the release adds quantization_config: MXFP4 experts)."""
MXFP4 = {
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
        "quant_method": "mxfp4",
    }
}


def _variant() -> ModelSpec:
    """The tiny model with YaRN's correction range rounded and the window in the odd layers."""
    tiny = tiny_spec("gpt_oss")
    return dataclasses.replace(
        tiny,
        yarn=dataclasses.replace(tiny.yarn, truncate=True),
        sliding_window=SlidingWindowSpec(size=6, layers=(1, 3)),
    )


def test_gpt_oss_family(tmp_path):
    check_family(tmp_path, FamilyCase("gpt_oss", variants=(_variant(),)))
    check_sglang_gpt_oss_names(torch.load(tmp_path / "reference-export.pt"))


def check_sglang_gpt_oss_names(exported) -> None:
    """Every exported name lands on a parameter of SGLang's gpt-oss through its loader's mapping: q/k/v
    into qkv_proj (its stacked_params_mapping), the fused experts through
    FusedMoE.make_expert_params_mapping_fused (compiled from the wheel, with the names the loader
    passes), sinks and the router by name; each module one SGLang's model assigns."""
    from tests.sglang_wheel import WheelUnavailable, load_defs, source, wheel_path

    try:
        wheel = zipfile.ZipFile(wheel_path())
    except WheelUnavailable as err:
        pytest.skip(str(err))
    loader = source(wheel, "models/gpt_oss.py")
    stacked = stacked_params_mapping(loader)
    assert [s for _, s, _ in stacked] == ["q_proj", "k_proj", "v_proj"], stacked
    names = dict(re.findall(r'ckpt_(\w+)_name="(\w+)"', loader[loader.index("make_expert_params_mapping_fused(") :]))
    path = "layers/moe/fused_moe_triton/layer.py"
    make = load_defs(wheel, {path: ["FusedMoE.make_expert_params_mapping_fused"]}, {})
    experts = make["make_expert_params_mapping_fused"].__func__(None, **{f"ckpt_{k}_name": v for k, v in names.items()})
    unquant = source(wheel, "layers/quantization/unquant.py")
    leaves = {"weight", "bias", *re.findall(r'register_parameter\("(\w+)"', unquant)}
    modules = assigned_modules([loader])
    for name in exported:
        target = next((name.replace(s, p) for p, s, _ in stacked if s in name and "mlp.experts" not in name), None)
        target = target or next((name.replace(w, p) for p, w, _ in experts if name.endswith(w)), name)
        *path_parts, leaf = [part for part in target.split(".") if not part.isdigit()]
        assert leaf in leaves or leaf in modules, (name, target)
        missing = [part for part in path_parts if part not in modules and part != "model"]
        assert not missing, f"{name} -> {target}: SGLang's gpt-oss has no module {missing}"


def test_packed_rows_stay_apart_in_the_windowed_layers(tmp_path):
    run_workers(_packed_equals_alone, 1, str(tmp_path))


def _packed_equals_alone(rank: int, world: int, root: str) -> None:
    """Two samples end to end in one row under the block-diagonal mask give each sample's logits alone:
    the window (4 positions) would otherwise let the second sample's first positions see the first's."""
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.packing import block_causal_mask
    from bapo_megatron.weights.layout import hf_to_megatron
    from tests.families import _setup, hf_state, random_hf_model

    cfg, _ = _setup()
    spec = tiny_spec("gpt_oss")
    model = mc.build_gpt_model(spec, cfg.model, cfg.parallel, pre_process=True, post_process=True).eval()
    padded = mc.padded_vocab(spec, cfg.model, cfg.parallel)
    model.load_state_dict(hf_to_megatron(spec, hf_state(random_hf_model(spec)), padded), strict=False)
    g = torch.Generator().manual_seed(3)
    first, second = (
        torch.randint(spec.vocab_size, (1, 9), generator=g),
        torch.randint(spec.vocab_size, (1, 7), generator=g),
    )
    row = torch.cat([first, second], dim=1)
    mask = block_causal_mask(torch.tensor([0, 9, 16]), 16)
    with torch.no_grad():
        packed = model(row, torch.arange(16).unsqueeze(0), attention_mask=mask)
        alone = [model(ids, torch.arange(ids.shape[1]).unsqueeze(0), attention_mask=None) for ids in (first, second)]
    want = torch.cat(alone, dim=1)
    rel = ((packed - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-5, f"a packed row's samples mix: logits differ by {rel:.2e} (relative)"
    assert family_of(spec).packing_leak(spec, te=False) is None


def test_gpt_oss_20b_config_is_read_as_its_shape():
    spec = ModelSpec.from_hf_config(GPT_OSS_20B)
    moe, window, yarn = spec.moe, spec.sliding_window, spec.yarn
    assert (spec.num_layers, spec.head_dim, spec.num_kv_heads, spec.rope_theta) == (24, 64, 8, 150000.0)
    assert (moe.num_experts, moe.top_k, moe.ffn_hidden_size, moe.sparse_layers) == (32, 4, 2880, tuple(range(24)))
    assert (moe.score_function, moe.norm_topk_prob, moe.expert_bias) == ("softmax", True, False)
    assert window == SlidingWindowSpec(size=128, layers=tuple(range(0, 24, 2)))
    assert (yarn.factor, yarn.original_max_position_embeddings, yarn.truncate) == (32.0, 4096, False)
    assert spec.attention_sinks and spec.linear_bias and spec.swiglu_limit == 7.0
    family = family_of(spec)
    fields = family.transformer_fields(spec)
    assert fields["window_size"] == (127, 0) and fields["window_attn_skip_freq"] == [1, 0] * 12
    assert (fields["softmax_type"], fields["glu_linear_offset"], fields["activation_func_clamp_value"]) == (
        "learnable",
        1.0,
        7.0,
    )
    assert fields["position_embedding_type"] == "yarn" and not fields["yarn_correction_range_round_to_int"]
    total = sum(sum(layer_params(spec, i).__dict__.values()) for i in range(spec.num_layers))
    total += 2 * spec.vocab_size * spec.hidden_size + spec.hidden_size
    assert 20.8e9 < total < 21.0e9  # gpt-oss-20b: 20.9B parameters
    for written in (spec, tiny_spec("gpt_oss"), _variant(), family.task_model(300, 512)):
        assert ModelSpec.from_hf_config(family.to_hf(written)) == written
    assert not family.cache_by_position(spec)
    with pytest.raises(ValueError, match="pre-split"):
        family.check_sglang_tp(spec, 2)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config.quant_method"),
        ({"swiglu_alpha": 1.5}, "swiglu_alpha"),
        ({"attention_bias": False}, "attention_bias"),
        ({"layer_types": ["chunked_attention", "full_attention"] * 12}, "layer_types"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type"),
        ({"rope_scaling": {**GPT_OSS_20B["rope_scaling"], "attention_factor": 1.2}}, "attention_factor"),
    ],
)
def test_what_is_not_mapped_is_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_config(GPT_OSS_20B | change)


def test_the_mxfp4_release_is_read_and_another_scheme_refused_saying_how_to_get_bf16_weights():
    assert ModelSpec.from_hf_config(GPT_OSS_20B | MXFP4) == ModelSpec.from_hf_config(GPT_OSS_20B)
    with pytest.raises(ConfigError, match="MXFP4 releases are read.*bf16 copy"):
        ModelSpec.from_hf_config(GPT_OSS_20B | {"quantization_config": {"quant_method": "awq"}})


def test_experts_map_both_ways_with_gate_and_up_interleaved():
    """An expert's Megatron fc1 is [gate; up] of transformers' interleaved columns (gate even, up odd),
    its biases likewise, and the map back is bitwise (every tensor random)."""
    from bapo_megatron.common.hf_io import expected_shapes
    from bapo_megatron.weights.layout import hf_to_megatron, megatron_to_hf

    spec = tiny_spec("gpt_oss")
    hf = {name: torch.randn(shape) for name, shape in expected_shapes(spec).items()}
    mg = hf_to_megatron(spec, hf, spec.vocab_size)
    expert, width = "decoder.layers.2.mlp.experts.local_experts.1.", spec.moe.ffn_hidden_size
    gate_up, bias = (
        hf["model.layers.2.mlp.experts.gate_up_proj"][1],
        hf["model.layers.2.mlp.experts.gate_up_proj_bias"][1],
    )
    assert torch.equal(mg[expert + "linear_fc1.weight"], torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1).T)
    assert torch.equal(mg[expert + "linear_fc1.bias"], torch.cat([bias[0::2], bias[1::2]]))
    assert torch.equal(mg[expert + "linear_fc2.weight"], hf["model.layers.2.mlp.experts.down_proj"][1].T)
    assert mg[expert + "linear_fc1.weight"].shape == (2 * width, spec.hidden_size)
    from bapo_megatron.weights.hf_load import expert_parts

    # Transformer Engine's grouped experts name their biases by local index too (EP maps them to global)
    assert expert_parts("mlp.experts.linear_fc2.bias3") == ("mlp.experts.linear_fc2.bias", 3, "")
    back = megatron_to_hf(spec, mg)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.e2e
def test_the_embedded_engine_generates_as_transformers(tmp_path):
    """The embedded engine serves gpt-oss (its windows' caches keep only the last positions:
    cache_by_position is False) as transformers' greedy generate does, past the window, a request
    continued after a cut (partial rollout) included."""
    from bapo_megatron.common.protocol import SamplingParams
    from bapo_megatron.engines.embedded.core import EngineCore
    from bapo_megatron.engines.embedded.request_queue import EngineRequest
    from tests.families import random_hf_model, save_hf_model

    spec = tiny_spec("gpt_oss")
    model = random_hf_model(spec)
    with torch.no_grad():  # a random model's greedy tokens must not tie: spread its logits
        model.lm_head.weight.mul_(20)
    save_hf_model(model, spec, tmp_path)
    prompts, tokens = ([5, 9, 17, 3], [100, 2, 7, 7, 7, 40, 11]), 10
    with torch.no_grad():
        made = [model.generate(torch.tensor([p]), max_new_tokens=tokens, do_sample=False)[0] for p in prompts]
    greedy = [t[len(p) :].tolist() for p, t in zip(prompts, made, strict=True)]
    core = EngineCore(tmp_path, max_batch=2)

    def run(requests):
        for r in requests:
            core.add(r)
        while core.busy:
            core.step()
        return {r.rid: r.output_ids for r in requests}

    def request(rid, prompt, n):
        return EngineRequest(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))

    whole = run([request(f"w{i}", p, tokens) for i, p in enumerate(prompts)])
    assert [whole[f"w{i}"] for i in range(len(prompts))] == greedy
    cut = run([request(f"c{i}", p, 4) for i, p in enumerate(prompts)])
    rest = run([request(f"r{i}", p + cut[f"c{i}"], tokens - 4) for i, p in enumerate(prompts)])
    assert [cut[f"c{i}"] + rest[f"r{i}"] for i in range(len(prompts))] == greedy
