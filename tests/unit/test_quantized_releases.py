"""Quantized releases read for training (common/hf_io.py through models/quantized.py): a tiny
DeepSeek-V3 in fp8 block scales and a tiny gpt-oss with MXFP4 experts, made here as their releases
store them, read dequantized as transformers dequantizes them; a missing or misshapen scale, or a
tensor quantized otherwise than the releases do, refused naming the tensor and its file."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bapo_megatron.common.hf_io import HFCheckpoint
from bapo_megatron.errors import BadInputError
from bapo_megatron.models.quantized import fp8_dequantize, mxfp4_dequantize
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from tests.quantized_releases import BLOCK, FP8, MTP, all_tensors, make_releases


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """The tiny models unquantized, and their releases (copies of them quantized as released)."""
    return make_releases(tmp_path_factory.mktemp("releases"))


def test_an_fp8_release_reads_as_transformers_dequantizes_it(releases):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    hf, stored = HFCheckpoint(releases / "deepseek-fp8"), all_tensors(releases / "deepseek-fp8")
    assert hf.spec == ModelSpec.from_hf_dir(releases / "deepseek") == tiny_spec("deepseek_v3")
    quantized = 0
    for name in hf.files:
        if stored[name].dtype == torch.float8_e4m3fn:
            scale = stored[name.removesuffix("weight") + "weight_scale_inv"]
            assert torch.equal(hf[name], _dequantize_fp8_weight(stored[name], scale, list(BLOCK), torch.float32))
            quantized += 1
        else:
            assert torch.equal(hf[name], stored[name])
    assert quantized > 20 and "model.layers.1.mlp.experts.0.gate_proj.weight" in hf


def test_an_mxfp4_release_reads_as_transformers_dequantizes_it(releases):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf, stored = HFCheckpoint(releases / "gpt_oss-mxfp4"), all_tensors(releases / "gpt_oss-mxfp4")
    assert hf.spec == ModelSpec.from_hf_dir(releases / "gpt_oss")
    for layer in range(hf.spec.num_layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            theirs = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"])
            assert torch.equal(hf[name], theirs)
    assert not any(name.endswith(("_blocks", "_scales")) for name in hf.files)


def _broken(releases: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of a release with its tensors changed by change(tensors)."""
    directory = tmp_path / name
    shutil.copytree(releases / name, directory)
    tensors = all_tensors(directory)
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


WEIGHT = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
SCALE = WEIGHT + "_scale_inv"
ROUTER = "model.layers.1.mlp.gate.weight"


def _quantized_router(t):
    t.update({ROUTER: t[ROUTER].to(torch.float8_e4m3fn), ROUTER + "_scale_inv": torch.ones(1, 4)})


def _unquantized(t):
    t.pop(SCALE)
    t[WEIGHT] = torch.ones(40, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda t: t.pop(SCALE), f"{WEIGHT} is quantized (F8_E4M3) but has no {SCALE}"),
        (lambda t: t.update({SCALE: t[SCALE][:2]}), f"{SCALE} is F32 (2, 4); its weight (40, 64) needs float32 (3, 4)"),
        (_quantized_router, f"{ROUTER} is quantized where"),
        (lambda t: t.update({ROUTER + "_scale_inv": torch.ones(1)}), f"{ROUTER}_scale_inv is a scale without"),
        (lambda t: t.update({"model.layers.1.mlp.experts.0.up_proj.input_scale": torch.ones(1)}), "scheme other"),
        (_unquantized, f"{WEIGHT} is stored as BF16, where a fp8 release quantizes its kind"),
    ],
    ids=["missing-scale", "misshapen-scale", "quantized-router", "lone-scale", "static-scale", "unquantized"],
)
def test_a_release_quantized_otherwise_is_refused_naming_tensor_and_file(releases, tmp_path, change, said):
    directory = _broken(releases, tmp_path, "deepseek-fp8", change)
    with pytest.raises(BadInputError) as err:
        HFCheckpoint(directory)
    assert str(err.value).startswith(f"{directory / 'model.safetensors'}: ") and said in str(err.value)


def test_a_scale_in_another_shard_than_its_weight_is_found(releases, tmp_path):
    """Shards split where they fall: a weight in one file, its scale in the next (named by the index)."""
    directory = tmp_path / "sharded"
    shutil.copytree(releases / "deepseek-fp8", directory)
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    second = {name for name in names if name.endswith("_scale_inv")} | set(names[::2])
    files = {"model-00001-of-00002.safetensors": set(names) - second, "model-00002-of-00002.safetensors": second}
    for file, part in files.items():
        save_file({name: tensors[name] for name in part}, str(directory / file))
    weight_map = {name: file for file, part in files.items() for name in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert weight_map[SCALE] != weight_map[WEIGHT]
    whole, sharded = HFCheckpoint(releases / "deepseek-fp8"), HFCheckpoint(directory)
    assert all(torch.equal(whole[name], sharded[name]) for name in whole.files)


def test_mxfp4_blocks_without_scales_are_refused(releases, tmp_path):
    name = "model.layers.0.mlp.experts.down_proj"
    directory = _broken(releases, tmp_path, "gpt_oss-mxfp4", lambda t: t.pop(name + "_scales"))
    with pytest.raises(BadInputError, match=f"{name}_blocks has no {name}_scales"):
        HFCheckpoint(directory)


def test_export_writes_the_release_layout_back(releases, tmp_path):
    """hf-to-mcore then mcore-to-hf (float32): the release's tensor names and dtypes, its fp8 codes
    bitwise and its scales within one float32 rounding, its quantization_config; with dequantized,
    unquantized and without it. `verify` on the release (partial edge blocks) passes."""
    from bapo_megatron.weights.convert import hf_to_mcore, mcore_to_hf, verify_conversion
    from bapo_megatron.weights.mcore_io import McoreCheckpoint

    release = releases / "deepseek-fp8"
    mcore = hf_to_mcore(release, tmp_path / "mcore", progress=False)
    out = mcore_to_hf(mcore, tmp_path / "hf", dtype="bfloat16", progress=False)
    ours, theirs = all_tensors(out), all_tensors(release)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype, name
        if tensor.dtype == torch.float8_e4m3fn:
            assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
        elif name.endswith("weight_scale_inv"):
            assert ((ours[name] - tensor).abs() <= 2.0**-23 * tensor).all(), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == FP8
    assert any(name.startswith(MTP) and name.endswith("_scale_inv") for name in ours)  # kept as stored
    # verify's reference reads the release as the trainer does (transformers refuses its partial blocks)
    assert verify_conversion(release, mcore, seq=8)["max_rel"] <= 1e-5
    plain = McoreCheckpoint(mcore, dequantized=True)
    assert "quantization_config" not in plain.config
    entries = plain.hf_entries(torch.bfloat16)
    assert {e.dtype for e in entries} == {torch.bfloat16, torch.float32}  # the expert bias in float32
    assert not any(e.name.endswith("weight_scale_inv") for e in entries)
    kept = MTP + "self_attn.q_b_proj.weight"
    scale = theirs[kept.removesuffix("weight") + "weight_scale_inv"]
    assert torch.equal(plain.kept[kept], fp8_dequantize(theirs[kept], scale, BLOCK).bfloat16())
    unquantized = mcore_to_hf(mcore, tmp_path / "bf16", dtype="bfloat16", progress=False, dequantized=True)
    read, written = HFCheckpoint(release), all_tensors(unquantized)
    assert "quantization_config" not in json.loads((unquantized / "config.json").read_text())
    for name in read.files:
        assert torch.equal(written[name], read[name].to(written[name].dtype)), name


def test_mxfp4_export_writes_the_experts_back_as_they_were(releases, tmp_path):
    from bapo_megatron.weights.convert import hf_to_mcore, mcore_to_hf

    release = releases / "gpt_oss-mxfp4"
    out = mcore_to_hf(hf_to_mcore(release, tmp_path / "mcore", progress=False), tmp_path / "hf", progress=False)
    ours, theirs = all_tensors(out), all_tensors(release)
    assert sorted(ours) == sorted(theirs)
    for name in (n for n in theirs if n.endswith(("_blocks", "_scales"))):
        # random nibbles: a block whose largest code is under 4 takes a smaller exponent, same values
        base = name.removesuffix("_blocks").removesuffix("_scales")
        assert torch.equal(
            mxfp4_dequantize(ours[base + "_blocks"], ours[base + "_scales"]),
            mxfp4_dequantize(theirs[base + "_blocks"], theirs[base + "_scales"]),
        )
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj_blocks").get_dtype() == "U8"


def test_transformers_loads_the_release_and_the_export_as_we_read_them(releases, tmp_path):
    """transformers on the CPU dequantizes an fp8 release itself (FineGrainedFP8, dequantize): its
    weights are ours, of the release and of its export (the layout written back loads). Its loader
    refuses partial blocks ("not divisible by scale grid"): this release's blocks tile every tensor."""
    import transformers

    from bapo_megatron.weights.convert import hf_to_mcore, mcore_to_hf

    release = releases / "deepseek-fp8-tiled"
    export = mcore_to_hf(hf_to_mcore(release, tmp_path / "mcore", progress=False), tmp_path / "hf", progress=False)
    for directory in (release, export):
        ours = HFCheckpoint(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        theirs = model.state_dict()
        shared = [name for name in ours.files if name in theirs]
        assert len(shared) > 20 and "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in shared
        for name in shared:
            assert torch.equal(theirs[name], ours[name].float()), (directory, name)


FP8_METHOD = "layers/quantization/fp8.py"
DEEPSEEK_LOADER = "models/deepseek_common/deepseek_weight_loader.py"


def test_sglang_loads_the_fp8_names_we_write(wheel):
    """An SGLang server started on an fp8 release holds each quantized linear as an fp8 `weight` and a
    float32 `weight_scale_inv` (Fp8LinearMethod, block scales; FusedMoE's w13_/w2_weight_scale_inv):
    every name of the export, scales included, lands on one through its DeepSeek loader's mapping
    (stacked projections, the fused latent down-projections, the experts)."""
    import re

    from bapo_megatron.common.hf_io import hf_entries
    from bapo_megatron.models.quantized import Quantization
    from tests.families import assigned_modules, sglang_param, stacked_params_mapping
    from tests.sglang_wheel import load_defs, source

    spec = tiny_spec("deepseek_v3")
    plain = [(e.name, e.shape, e.dtype) for e in hf_entries(spec, torch.bfloat16)]
    names = [name for name, _, _ in Quantization("fp8", (128, 128)).entries(plain)]
    assert sum(name.endswith("weight_scale_inv") for name in names) > 20
    fp8, text = source(wheel, FP8_METHOD), source(wheel, DEEPSEEK_LOADER)
    leaves = {"weight", "bias", "e_score_correction_bias", *re.findall(r'register_parameter\(\s*"(\w+)"', fp8)}
    assert {"weight_scale_inv", "w13_weight_scale_inv", "w2_weight_scale_inv"} <= leaves
    downs = ("q_a_proj", "kv_a_proj_with_mqa")
    fused = [("self_attn.fused_qkv_a_proj_with_mqa.", f"self_attn.{down}.", i) for i, down in enumerate(downs)]
    stacked = fused + stacked_params_mapping(text)
    make = load_defs(wheel, {"layers/moe/fused_moe_triton/layer.py": ["FusedMoE.make_expert_params_mapping"]}, {})
    projections = {
        "ckpt_gate_proj_name": "gate_proj",
        "ckpt_down_proj_name": "down_proj",
        "ckpt_up_proj_name": "up_proj",
    }
    experts = make["make_expert_params_mapping"].__func__(None, **projections, num_experts=spec.moe.num_experts)
    modules = assigned_modules([text, source(wheel, "models/deepseek_v2.py")])
    for name in names:
        target = sglang_param(name, stacked, experts)
        *path, leaf = [part for part in target.split(".") if not part.isdigit()]
        assert leaf in leaves or leaf in modules, (name, target)
        assert all(part in modules for part in path), (name, target)
    scale = sglang_param("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv", stacked, experts)
    assert scale == "model.layers.1.mlp.experts.w13_weight_scale_inv"
