"""Qwen3.5 / Qwen3.6 (Gated DeltaNet in three of every four layers, gated full attention in the
fourth), dense and MoE, and Qwen3-Next, through the family checks (tests/families.py): transformers'
logits, conversion both ways, TP 2 (sequence parallel), PP 2 (and EP 2, routed) equal to one process
(the updated weights: gradients checked); the exported names through SGLang 0.5.23's Qwen3.5 loader;
the released multimodal layout converted both ways; the released Qwen3.5-27B config.json read into the
spec, what is not mapped refused by name."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from bapo_megatron.errors import ConfigError
from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from bapo_megatron.trainer.memory.estimate import layer_params
from tests.dist.launch import run_workers
from tests.families import FamilyCase, SGLangLoader, check_family, check_sglang_names, hf_state_of_dir

QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "initializer_range": 0.02,
    "intermediate_size": 17408,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 24,
    "num_hidden_layers": 64,
    "num_key_value_heads": 4,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "tie_word_embeddings": False,
    "vocab_size": 248320,
}
"""Qwen/Qwen3.5-27B's text_config, as the text-only layout's config.json (architectures, model_type)."""


def test_qwen3_5_family(tmp_path):
    tiny = tiny_spec("qwen3_5_text")
    tied = dataclasses.replace(tiny, tie_embeddings=True, num_kv_heads=1)  # MQA, tied embeddings
    check_family(tmp_path, FamilyCase("qwen3_5_text", variants=(tied,)))
    spec, initial = tiny_spec("qwen3_5_text"), hf_state_of_dir(tmp_path / "hf")
    exported = torch.load(tmp_path / "reference-export.pt")
    for layer in spec.linear_attention.layers:  # the delta-rule layers train too
        for part in ("in_proj_qkv.weight", "conv1d.weight", "A_log", "norm.weight"):
            name = f"model.layers.{layer}.linear_attn.{part}"
            assert not torch.equal(exported[name], initial[name]), name
    check_sglang_names(sglang_loader("Qwen3_5ForCausalLM"), exported, spec)
    from tests.families import random_hf_model, save_hf_model

    save_hf_model(random_hf_model(tiny_spec("qwen3_next")), tiny_spec("qwen3_next"), tmp_path / "hf-qwen3_next")
    run_workers(_hf_loads_at_tp2, 2, str(tmp_path))


def _hf_loads_at_tp2(rank: int, world: int, root: str) -> None:
    """A HF directory loaded straight into a TP 2 trainer (weights/hf_load.py: each rank copies its
    slice of every in_proj and conv1d part, Qwen3.5's row ranges and Qwen3-Next's per-key-head
    groups) and exported live (each part gathered whole): the HF tensors, bitwise."""
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.gather import hf_buckets_to_rank0
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from tests.families import _setup

    for architecture, directory in (("qwen3_5_text", "hf"), ("qwen3_next", "hf-qwen3_next")):
        cfg, info = _setup(2, 1, 1)
        trainer = PolicyTrainer(tiny_spec(architecture), cfg, info)
        load_hf_into_trainer(trainer, Path(root) / directory)
        exported = {n: t.clone() for bucket in hf_buckets_to_rank0(trainer, 1 << 16) for n, t in bucket}
        if rank == 0:
            original = hf_state_of_dir(Path(root) / directory)
            assert set(exported) == set(original), sorted(set(exported) ^ set(original))[:4]
            for key, tensor in original.items():
                assert torch.equal(exported[key], tensor), (architecture, key)


def test_qwen3_5_moe_family(tmp_path):
    """Qwen3.5-MoE: the hybrid with routed experts and a gated shared expert; EP 2 too, routes replayed.
    Qwen3-Next (its delta rule's projections grouped per key head, a dense first layer, the top-k
    renormalised or not) against transformers as variants."""
    qwen3_next = tiny_spec("qwen3_next")  # transformers' logits and the map back (its own in_proj layout)
    unnormalised = dataclasses.replace(qwen3_next, moe=dataclasses.replace(qwen3_next.moe, norm_topk_prob=False))
    check_family(tmp_path, FamilyCase("qwen3_5_moe_text", variants=(qwen3_next, unnormalised)))
    spec = tiny_spec("qwen3_5_moe_text")
    check_sglang_names(sglang_loader("Qwen3_5MoeForCausalLM"), torch.load(tmp_path / "reference-export.pt"), spec)


def test_released_multimodal_layout_converts_both_ways(tmp_path):
    """Qwen3_5ForConditionalGeneration (the released layout: the text model under
    model.language_model., its config under text_config, a vision tower beside it) read for text RL:
    the same spec, hf-to-mcore with transformers' logits (verify), mcore-to-hf bitwise, the vision
    tower included."""
    run_workers(_multimodal_round_trip, 1, str(tmp_path))


def _multimodal_round_trip(rank: int, world: int, root: str) -> None:
    import sys

    import transformers

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.weights.convert import verify_conversion
    from tests.families import TOOLS, multimodal_qwen3_5_config, random_hf_model

    sys.path.insert(0, str(TOOLS))
    import convert_checkpoint as cli

    spec, hf, mcore, back = tiny_spec("qwen3_5_text"), Path(root) / "hf", Path(root) / "mcore", Path(root) / "back"
    config = multimodal_qwen3_5_config(spec)
    text_model = random_hf_model(spec)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the text model's random weights, under the multimodal names
        for name, tensor in text_model.state_dict().items():
            disk = name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")
            model.state_dict()[disk].copy_(tensor)
    model.save_pretrained(hf, max_shard_size="200KB")
    _add_mtp_layer(hf, spec)
    assert HFCheckpoint(hf).spec == spec
    assert cli.main(["hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--no-progress"]) == 0
    assert verify_conversion(hf, mcore)["max_rel"] <= 1e-5
    assert cli.main(["mcore-to-hf", "--mcore", str(mcore), "--out", str(back), "--no-progress"]) == 0
    original, returned = hf_state_of_dir(hf), hf_state_of_dir(back)
    assert set(returned) == set(original), sorted(set(returned) ^ set(original))[:4]
    assert any(k.startswith("model.visual.") for k in original) and "mtp.fc.weight" in original
    for key, tensor in original.items():
        assert torch.equal(returned[key], tensor), key


def _add_mtp_layer(hf: Path, spec: ModelSpec) -> None:
    """A multi-token-prediction layer beside the model, as the released checkpoints carry one
    (`mtp.*`, text_config.mtp_num_hidden_layers): kept, not trained."""
    from safetensors.torch import save_file

    d = spec.hidden_size
    g = torch.Generator().manual_seed(3)
    tensors = {"mtp.fc.weight": torch.randn(d, 2 * d, generator=g), "mtp.norm.weight": torch.randn(d, generator=g)}
    tensors["mtp.layers.0.mlp.down_proj.weight"] = torch.randn(d, 8, generator=g).to(torch.bfloat16)
    save_file(tensors, str(hf / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    index["weight_map"] |= dict.fromkeys(tensors, "mtp.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((hf / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (hf / "config.json").write_text(json.dumps(config))


# -- SGLang


def sglang_loader(body_class: str, loader: str = "models/qwen3_5.py") -> SGLangLoader:
    """SGLang 0.5.23's Qwen3.5 / Qwen3-Next loader: Qwen3.5's text wrapper (models/qwen3_5_text.py)
    strips `model.` and loads lm_head itself, the body's load_weights (`body_class` in `loader`) drops
    `.self_attn` and applies its stacked mapping (q/k/v, gate/up, in_proj_qkv + in_proj_z,
    in_proj_b + in_proj_a); its MLP, shared expert and experts' block are models/qwen2_moe.py's."""
    rules = [
        (loader, 'name = name.replace(".self_attn", "")'),
        (loader, '("in_proj_qkvz.", "in_proj_qkv.", (0, 1, 2))'),
        (loader, '("in_proj_ba.", "in_proj_a.", 1)'),
    ]
    wrapped = loader == "models/qwen3_5.py"
    if wrapped:
        wrapper = "models/qwen3_5_text.py"
        rules += [(wrapper, "yield name[len(_MODEL_PREFIX) :], loaded_weight"), (wrapper, '_MODEL_PREFIX = "model."')]
    return SGLangLoader(
        loader,
        sources=("models/qwen2_moe.py",),
        body_class=body_class,
        rules=tuple(rules),
        prefix="model." if wrapped else "",
        dropped=".self_attn",
        own=("lm_head.weight",) if wrapped else (),
    )


# -- config.json and the family's answers (one process, no model)


def test_qwen3_5_27b_config_is_read_as_its_shape():
    spec = ModelSpec.from_hf_config(QWEN3_5_27B)
    la = spec.linear_attention
    assert (spec.num_layers, spec.head_dim, spec.rotary_fraction, spec.rope_theta) == (64, 256, 0.25, 1e7)
    assert la.layers == tuple(i for i in range(64) if i % 4 != 3)
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.conv_kernel_dim) == (16, 48, 128, 4)
    family = family_of(spec)
    fields = family.transformer_fields(spec)
    assert fields["linear_attention_freq"] == [int(i % 4 != 3) for i in range(64)]
    assert fields["attention_output_gate"] and fields["layernorm_zero_centered_gamma"] and fields["qk_layernorm"]
    total = sum(sum(layer_params(spec, i).__dict__.values()) for i in range(spec.num_layers))
    total += 2 * spec.vocab_size * spec.hidden_size + spec.hidden_size
    assert 26.8e9 < total < 27e9  # Qwen3.5-27B's language model (its vision tower and MTP layer aside)
    assert family.to_hf(spec)["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert ModelSpec.from_hf_config(family.to_hf(spec)) == spec


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"output_gate_type": "swish"}, "output_gate_type"),
        ({"layer_types": ["sliding_attention"] * 64}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"linear_num_value_heads": 24}, "linear_num_value_heads"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method='awq'"),
    ],
)
def test_what_is_not_mapped_is_refused_by_name(change, field):
    with pytest.raises(ConfigError, match=field):
        ModelSpec.from_hf_config(QWEN3_5_27B | change)


def test_quantized_releases_are_read_and_other_schemes_refused_by_name():
    """Qwen3.5-MoE's and Qwen3-Next's fp8 releases (block scales: models/quantized.py) are read, other
    schemes refused by name, the multimodal layout's too, whose quantization_config sits at the top
    level beside text_config."""
    fp8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    awq = {"quantization_config": {"quant_method": "awq"}}
    for name in ("qwen3_5_moe_text", "qwen3_next"):
        assert ModelSpec.from_hf_config(family_of(name).to_hf(tiny_spec(name)) | fp8) == tiny_spec(name)
        with pytest.raises(ConfigError, match="quantization_config.quant_method='awq'"):
            ModelSpec.from_hf_config(family_of(name).to_hf(tiny_spec(name)) | awq)
    text = {k: v for k, v in QWEN3_5_27B.items() if k != "architectures"}
    multimodal = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "tie_word_embeddings": False,
    }
    assert ModelSpec.from_hf_config(multimodal).num_layers == 64
    assert ModelSpec.from_hf_config(multimodal | fp8) == ModelSpec.from_hf_config(multimodal)
    with pytest.raises(ConfigError, match="quantization_config.quant_method='awq'"):
        ModelSpec.from_hf_config(multimodal | awq)


def test_the_dry_run_refuses_transformer_engine_as_the_run_does(tmp_path):
    """Qwen3.5's block spec is built from Megatron's local modules only: the dry run (preflight.validate,
    planning another machine) refuses model.transformer_impl=transformer_engine as layer_spec does."""
    from bapo_megatron.cli.dry_run import dry_run
    from bapo_megatron.cli.dry_run_memory import GIB
    from bapo_megatron.config import load_config

    spec = tiny_spec("qwen3_5_text")
    (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
    overrides = [f"model.hf_path={tmp_path}", "model.transformer_impl=transformer_engine"]
    with pytest.raises(ConfigError, match="model.transformer_impl='transformer_engine': Qwen3.5's hybrid layers"):
        dry_run(load_config(None, overrides), 2, 80 * GIB)
    with pytest.raises(ConfigError, match="model.transformer_impl"):
        family_of(spec).layer_spec(spec, te=True)
    assert dry_run(load_config(None, overrides[:1]), 2, 80 * GIB)


def test_layer_params_are_the_hf_tensors():
    """The memory estimate counts every HF tensor of each layer kind (delta rule, gated attention)."""
    spec = tiny_spec("qwen3_5_text")
    family = family_of(spec)
    for layer in range(spec.num_layers):
        want = sum(math.prod(shape) for shape in family.hf_layer_shapes(spec, layer).values())
        assert sum(family.layer_params(spec, layer).values()) == want, layer


def test_what_layouts_and_packing_it_refuses():
    from bapo_megatron.models.spec import check_layout

    spec = tiny_spec("qwen3_5_text")
    family = family_of(spec)
    with pytest.raises(ValueError, match="Hugging Face directory"):
        family.check_sglang_tp(spec, 1)
    assert family.packing_leak(spec, te=False) and family.packing_leak(spec, te=True)
    assert not family.cache_by_position(spec)  # the embedded engine runs each request on a state of its own
    four_groups = dataclasses.replace(spec, num_kv_heads=4)
    check_layout(four_groups, 2, 1)
    with pytest.raises(ConfigError, match="linear-attention key heads"):
        check_layout(four_groups, 4, 1)  # its 2 key heads of linear attention


def test_the_gated_delta_net_fallback_still_fits_megatron():
    """Canary for models/gdn.py: megatron-core's GatedDeltaNet still checks HAVE_FLA at construction,
    calls the module's `l2norm` and `chunk_gated_delta_rule` (which the fallback supplies without
    fla), splits in_proj and conv1d into the parts recipes.Parts names, and marks conv1d, dt_bias and
    A_log tensor-parallel without a partition_dim."""
    import inspect

    from megatron.core.ssm import gated_delta_net

    from bapo_megatron.models.gdn import SUPPORTED_MEGATRON_CORE, l2norm
    from bapo_megatron.models.qwen3_5 import IN_PROJ_PARTS
    from bapo_megatron.trainer.cpu_shim import megatron_core_version

    assert megatron_core_version() == SUPPORTED_MEGATRON_CORE
    source = inspect.getsource(gated_delta_net.GatedDeltaNet)
    assert "if not HAVE_FLA:" in source and "query = l2norm(query.contiguous())" in source
    assert "core_attn_out, last_recurrent_state = chunk_gated_delta_rule(" in source
    compact = "".join(source.split())
    assert json.dumps(list(IN_PROJ_PARTS), separators=(",", ":")) in compact  # in_proj's parts, in its order
    assert 'setattr(self.conv1d.weight, "tensor_model_parallel", True)' in source
    x = torch.randn(3, 8)
    assert torch.allclose(l2norm(x), torch.nn.functional.normalize(x, dim=-1), atol=1e-5)


def test_the_torch_delta_rule_on_a_cuda_machine_is_said_once(monkeypatch):
    """Without fla the fallback stays for the process: on CPU silently, with CUDA one warning."""
    import warnings

    from megatron.core.ssm import gated_delta_net as gdn

    from bapo_megatron.models.gdn import torch_fallback

    for cuda, said in ((False, 0), (True, 1)):
        monkeypatch.setattr(gdn, "HAVE_FLA", False)
        monkeypatch.setattr(gdn, "chunk_gated_delta_rule", None)  # as megatron-core leaves it without fla
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch_fallback() and torch_fallback()
        assert gdn.chunk_gated_delta_rule is gdn.torch_chunk_gated_delta_rule
        assert [str(w.message) for w in caught if "fla" in str(w.message)] == [str(w.message) for w in caught]
        assert len(caught) == said, [str(w.message) for w in caught]


def test_the_moe_layouts_read_their_expert_layers():
    """Qwen3.5-MoE: experts in every layer (dense layers refused by name); Qwen3-Next: transformers'
    mlp_only_layers / decoder_sparse_step rule, its top-k renormalisation as configured."""
    moe = family_of("qwen3_5_moe_text").to_hf(tiny_spec("qwen3_5_moe_text"))
    assert ModelSpec.from_hf_config(moe).moe.sparse_layers == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(moe | {"mlp_only_layers": [0]})
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        ModelSpec.from_hf_config({k: v for k, v in moe.items() if k != "shared_expert_intermediate_size"})
    nxt = family_of("qwen3_next").to_hf(tiny_spec("qwen3_next"))
    spec = ModelSpec.from_hf_config(nxt | {"mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": False})
    assert spec.moe.sparse_layers == (1, 3) and not spec.moe.norm_topk_prob
    assert family_of(spec).transformer_fields(spec)["moe_layer_freq"] == [0, 1, 0, 1]
    with pytest.raises(ConfigError, match="decoder_sparse_step"):
        ModelSpec.from_hf_config(nxt | {"decoder_sparse_step": 0})


@pytest.mark.parametrize(
    ("name", "body_class", "loader"),
    [
        ("qwen3_5_text", "Qwen3_5ForCausalLM", "models/qwen3_5.py"),
        ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "models/qwen3_5.py"),
        ("qwen3_next", "Qwen3NextForCausalLM", "models/qwen3_next.py"),
    ],
)
def test_names_are_what_sglangs_loader_maps(name, body_class, loader):
    """Each family's HF names (what its export writes: the family test checks the export's names are
    the HF checkpoint's) through SGLang 0.5.23's loader for it."""
    from bapo_megatron.common.hf_io import expected_shapes

    spec = tiny_spec(name)
    check_sglang_names(sglang_loader(body_class, loader), expected_shapes(spec), spec)
