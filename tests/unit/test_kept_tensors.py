"""A checkpoint's tensors beyond the text model: the family's disk layout maps their names in one place
(HFCheckpoint reads the text model by canonical names whatever the layout), the tensors it keeps are
checked and carried bitwise (the kept file a Megatron checkpoint holds), and any other tensor is still
refused by name. The round trip through Megatron is tests/dist/test_kept_tensors.py's."""

import json

import pytest
import torch

from bapo_megatron.common.hf_io import KEPT_FILE, HFCheckpoint, expected_shapes, open_kept_file
from bapo_megatron.models import FAMILIES
from bapo_megatron.models.on_disk import MULTIMODAL_LAYOUT, TEXT_LAYOUT
from bapo_megatron.models.spec import ModelSpec, tiny_spec
from bapo_megatron.trainer.checkpoint import HF_CONFIG, model_files
from tests import toy_layouts as toys


@pytest.fixture(autouse=True)
def toy_families(monkeypatch):
    for family in (toys.ToyMtp(), toys.ToyVL()):
        monkeypatch.setitem(FAMILIES, family.name, family)


@pytest.fixture
def multimodal(tmp_path):
    tensors = toys.multimodal_checkpoint(tmp_path / "vl")
    return tmp_path / "vl", tensors


def test_layout_names_both_ways():
    for name in ("model.layers.3.mlp.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        for layout in (TEXT_LAYOUT, MULTIMODAL_LAYOUT):
            assert layout.canonical_name(layout.disk_name(name)) == name
    assert MULTIMODAL_LAYOUT.disk_name("model.norm.weight") == "model.language_model.norm.weight"
    assert MULTIMODAL_LAYOUT.canonical_name("model.visual.blocks.0.attn.qkv.weight") is None


def test_multimodal_layout_reads_the_text_model_and_keeps_the_vision_tower(multimodal):
    directory, tensors = multimodal
    hf = HFCheckpoint(directory)
    assert hf.spec == FAMILIES["toy_vl_text"].tiny()  # from text_config, tie_word_embeddings from the top
    assert set(hf.keys()) == set(expected_shapes(hf.spec))
    assert torch.equal(hf["model.norm.weight"], tensors["model.language_model.norm.weight"])
    assert [e.name for e in hf.kept.entries()] == sorted(toys.VISION_TENSORS)
    for entry in hf.kept.entries():
        assert toys.bitwise_equal(hf.kept[entry.name], tensors[entry.name])


def test_mtp_layers_are_kept_and_their_count_is_the_configs(tmp_path):
    tensors = toys.mtp_checkpoint(tmp_path / "mtp", mtp_layers=2)
    hf = HFCheckpoint(tmp_path / "mtp")
    assert len(hf.kept) == 2 * len(toys.MTP_TENSORS) and "model.layers.4.eh_proj.weight" not in hf
    fp8 = "model.layers.5.mlp.down_proj.weight"
    assert toys.bitwise_equal(hf.kept[fp8], tensors[fp8]) and tensors[fp8].dtype == torch.float8_e4m3fn
    config = json.loads((tmp_path / "mtp" / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"does not account for, e\.g\. model\.layers\.5\.eh_proj\.weight in model-"):
        HFCheckpoint(tmp_path / "mtp")


@pytest.mark.parametrize("name", ["mtp.fc.weight", "model.language_model.layers.9.mlp.up_proj.weight", "model.extra"])
def test_a_tensor_neither_expected_nor_kept_is_refused_by_name(tmp_path, name):
    toys.multimodal_checkpoint(tmp_path / "vl", extra={name: torch.zeros(2)})
    with pytest.raises(ValueError, match=rf"1 tensors that config.json does not account for, e\.g\. {name} in model-"):
        HFCheckpoint(tmp_path / "vl")


def test_a_kept_tensor_of_a_dtype_not_carried_is_refused(tmp_path):
    toys.multimodal_checkpoint(tmp_path / "vl", extra={"model.visual.odd": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match=r"model\.visual\.odd"):
        HFCheckpoint(tmp_path / "vl")


def test_the_carried_file_holds_the_kept_tensors_bitwise(multimodal, tmp_path):
    directory, tensors = multimodal
    spec = ModelSpec.from_hf_dir(directory)
    files = model_files(spec, str(directory))
    assert json.loads(files[HF_CONFIG]) == json.loads((directory / "config.json").read_text())
    files[KEPT_FILE](tmp_path / KEPT_FILE)  # written when the checkpoint is, streamed
    carried = open_kept_file(tmp_path / KEPT_FILE, spec, json.loads(files[HF_CONFIG]))
    assert [e.name for e in carried.entries()] == sorted(toys.VISION_TENSORS)
    assert all(toys.bitwise_equal(carried[n], tensors[n]) for n in toys.VISION_TENSORS)
    # read against a config that keeps nothing (the text layout's), the carried file is refused by name
    text = json.loads(files[HF_CONFIG])["text_config"]
    text_config = {**text, "architectures": ["ToyVLForConditionalGeneration"], "tie_word_embeddings": False}
    with pytest.raises(ValueError, match=rf"{KEPT_FILE}: model\.visual\.blocks\.0\.attn\.qkv\.weight is no tensor"):
        open_kept_file(tmp_path / KEPT_FILE, spec, text_config)


def test_a_model_without_kept_tensors_carries_no_kept_file(tmp_path):
    toys.text_checkpoint(tmp_path / "text")
    assert KEPT_FILE not in model_files(ModelSpec.from_hf_dir(tmp_path / "text"), str(tmp_path / "text"))


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_every_family_answers_the_disk_questions(name):
    """Typed answers; a causal LM's own layout; MTP layers kept where config.json counts them."""
    if name not in FAMILIES:
        pytest.skip(f"{name} is not registered")
    family = FAMILIES[name]
    spec = family.tiny()
    hf = family.to_hf(spec)
    assert family.disk_layout(hf) == TEXT_LAYOUT and not family.kept_tensors(spec, hf)
    if "num_nextn_predict_layers" in hf:  # DeepSeek-V3's and GLM-4.5's multi-token prediction
        kept = family.kept_tensors(spec, {**hf, "num_nextn_predict_layers": 1})
        assert f"model.layers.{spec.num_layers}.eh_proj.weight" in kept
        assert f"model.layers.{spec.num_layers - 1}.mlp.gate.weight" not in kept


def test_the_tensors_stored_in_float32_are_the_familys_answer(monkeypatch):
    """hf_entries asks the family which tensors a checkpoint of any dtype stores in float32
    (Family.float32_tensor: an expert bias); a family answering for another tensor is heard."""
    from bapo_megatron.common.hf_io import hf_entries

    dtypes = {e.name: e.dtype for e in hf_entries(tiny_spec("deepseek_v3"), torch.bfloat16)}
    assert {n for n, d in dtypes.items() if d == torch.float32} == {
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2, 3)
    }
    family = toys.ToyMtp()
    monkeypatch.setattr(family, "float32_tensor", lambda name: name == "model.norm.weight")
    monkeypatch.setitem(FAMILIES, family.name, family)
    dtypes = {e.name: e.dtype for e in hf_entries(family.tiny(), torch.bfloat16)}
    assert dtypes["model.norm.weight"] == torch.float32 and dtypes["lm_head.weight"] == torch.bfloat16


def test_qwen3_5_released_layout_through_the_questions(tmp_path):
    """transformers' own Qwen3_5ForConditionalGeneration checkpoint, read by models/qwen3_5.py's own
    answers: the text model by canonical names, the vision tower and mtp.* (mtp_num_hidden_layers)
    kept, anything else refused."""
    family = FAMILIES["qwen3_5_text"]
    spec = family.tiny()
    on_disk = toys.released_qwen3_5(tmp_path / "released")
    hf = HFCheckpoint(tmp_path / "released")
    assert hf.spec == spec and set(hf.keys()) == set(expected_shapes(spec))
    assert torch.equal(hf["model.norm.weight"], on_disk["model.language_model.norm.weight"])
    kept = {e.name for e in hf.kept.entries()}
    assert "mtp.fc.weight" in kept and {n for n in on_disk if n.startswith("model.visual.")} <= kept
    toys.released_qwen3_5(tmp_path / "other", extra={"model.audio.x": torch.ones(2)})
    with pytest.raises(ValueError, match=r"e\.g\. model\.audio\.x in model\.safetensors"):
        HFCheckpoint(tmp_path / "other")


def test_qwen3_5_released_tie_is_the_top_levels(tmp_path):
    """transformers and SGLang read tie_word_embeddings at the top level of the multimodal config only:
    a text_config stating another value is refused by name (its lm_head.weight is real), and a
    released checkpoint that ties at the top level is read tied."""
    toys.released_qwen3_5(tmp_path / "untied", tie=(False, True))
    with pytest.raises(ValueError, match=r"text_config\.tie_word_embeddings=True but tie_word_embeddings=False"):
        HFCheckpoint(tmp_path / "untied")
    toys.released_qwen3_5(tmp_path / "tied", tie=(True, False))
    with pytest.raises(ValueError, match=r"text_config\.tie_word_embeddings=False but tie_word_embeddings=True"):
        HFCheckpoint(tmp_path / "tied")
    toys.released_qwen3_5(tmp_path / "both", tie=(True, True))
    assert HFCheckpoint(tmp_path / "both").spec.tie_embeddings
