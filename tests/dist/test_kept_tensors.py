"""Checkpoints that hold more than the text model go HF -> Megatron -> HF in the layout they came in:
multi-token-prediction layers (a toy family, GLM-4.5 and DeepSeek-V3) and a multimodal layout (the
text model under model.language_model., a vision tower beside it, config.json's text_config: a toy's and
transformers' own Qwen3_5ForConditionalGeneration) come back
bitwise, every tensor under its own name, the same config.json, the index covering them; the trainer
loads the multimodal layout's text weights as it loads the same model's text layout, and a run started
from the Megatron checkpoint carries its kept tensors on. One process (a world of one), one launch."""

import json
from pathlib import Path

import torch

from tests import toy_layouts as toys
from tests.dist.launch import run_workers

SHARD_BYTES = 60_000  # several output files: the index must cover the kept tensors too


def _real_family_checkpoint(directory: Path, name: str) -> dict[str, torch.Tensor]:
    """A tiny `name` checkpoint (random text weights) with one MTP layer after its decoder."""
    from bapo_megatron.models import FAMILIES

    family = FAMILIES[name]
    spec = family.tiny()
    config = {**family.to_hf(spec), "num_nextn_predict_layers": 1, "torch_dtype": "float32"}
    tensors = toys.text_tensors(spec, seed=3)
    g = torch.Generator().manual_seed(4)
    for suffix, (shape, dtype) in toys.MTP_TENSORS.items():
        tensors[f"model.layers.{spec.num_layers}.{suffix}"] = (torch.randn(shape, generator=g)).to(dtype)
    toys.save_checkpoint(directory, config, tensors)
    return tensors


def _released_qwen3_5(directory: Path) -> dict[str, torch.Tensor]:
    """transformers' Qwen3_5ForConditionalGeneration saved, its config.json as the released one (dtype)."""
    tensors = toys.released_qwen3_5(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    return tensors


def _round_trip(root: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    from bapo_megatron.common.hf_io import INDEX, KEPT_FILE
    from bapo_megatron.weights.convert import hf_to_mcore, mcore_to_hf

    hf_to_mcore(root / name, root / f"{name}-mcore", progress=False)
    assert (root / f"{name}-mcore" / KEPT_FILE).is_file(), name
    mcore_to_hf(root / f"{name}-mcore", root / f"{name}-back", progress=False, max_shard_bytes=SHARD_BYTES)
    back = toys.read_dir(root / f"{name}-back")
    assert sorted(back) == sorted(tensors), (name, sorted(set(back) ^ set(tensors))[:4])
    different = [n for n in tensors if not toys.bitwise_equal(back[n], tensors[n])]
    assert not different, (name, different[:4])
    config = json.loads((root / name / "config.json").read_text())
    assert json.loads((root / f"{name}-back" / "config.json").read_text()) == config, name
    index = json.loads((root / f"{name}-back" / INDEX).read_text())["weight_map"]
    assert sorted(index) == sorted(tensors) and len(set(index.values())) > 1, name


def _text_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    """The Megatron model's weights loaded from HF directory `name` the trainer's way (hf_load)."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.weights.convert import _model
    from bapo_megatron.weights.hf_load import load_hf_weights

    hf = HFCheckpoint(root / name)
    model = _model(hf.spec)
    load_hf_weights([model], hf.spec, hf, mc.padded_vocab(hf.spec, ModelConfig(), ParallelConfig()))
    return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def _carried_on(root: Path) -> None:
    """A run started from the multimodal model's Megatron checkpoint (model.mcore_path, its config from
    model.hf_path without weights) carries the vision tower into its own checkpoints, bitwise."""
    import shutil

    from bapo_megatron.common.hf_io import KEPT_FILE, open_kept_file
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.checkpoint import model_files

    config_only = root / "vl-config"
    config_only.mkdir()
    shutil.copy(root / "vl" / "config.json", config_only / "config.json")
    spec = ModelSpec.from_hf_dir(config_only)
    files = model_files(spec, str(config_only), str(root / "vl-mcore"))
    files[KEPT_FILE](root / "run-kept.safetensors")
    carried = open_kept_file(root / "run-kept.safetensors", spec, json.loads(files["hf_config.json"]))
    original = open_kept_file(root / "vl-mcore" / KEPT_FILE, spec, json.loads(files["hf_config.json"]))
    assert [e.name for e in carried.entries()] == sorted(toys.VISION_TENSORS)
    assert all(toys.bitwise_equal(carried[e.name], original[e.name]) for e in original.entries())


def _all(rank: int, world: int, root: str) -> None:
    toys.register()
    root = Path(root)
    cases = {
        "mtp": toys.mtp_checkpoint(root / "mtp", mtp_layers=2),
        "vl": toys.multimodal_checkpoint(root / "vl"),
        "glm4_moe": _real_family_checkpoint(root / "glm4_moe", "glm4_moe"),
        "deepseek_v3": _real_family_checkpoint(root / "deepseek_v3", "deepseek_v3"),
        "qwen3_5": _released_qwen3_5(root / "qwen3_5"),
    }
    for name, tensors in cases.items():
        _round_trip(root, name, tensors)
    toys.text_checkpoint(root / "text")
    multimodal, text = _text_weights(root, "vl"), _text_weights(root, "text")
    assert multimodal.keys() == text.keys() and all(torch.equal(multimodal[k], text[k]) for k in text)
    _carried_on(root)


def test_kept_tensors_and_layouts_round_trip(tmp_path):
    run_workers(_all, 1, str(tmp_path))
