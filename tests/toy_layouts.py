"""Test families whose checkpoints hold more than the text model (models/on_disk.py), and their tiny
checkpoints: ToyMtp keeps multi-token-prediction layers after its decoder (DeepSeek-V3's and GLM-4.5's
way), ToyVL is a multimodal layout (Qwen3.5's released one: the text model under
model.language_model., its config under text_config, a vision tower beside it). Each is Qwen3's
decoder, so Megatron builds it; `register()` adds them to FAMILIES (in a spawned worker too).
released_qwen3_5 is the real Qwen3.5 family's released checkpoint, as transformers saves it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bapo_megatron.common.hf_io import expected_shapes
from bapo_megatron.models import FAMILIES
from bapo_megatron.models.family import tiny_fields
from bapo_megatron.models.on_disk import MULTIMODAL_LAYOUT, DiskLayout, KeptTensors, extra_layers, nested_layout
from bapo_megatron.models.qwen3 import Qwen3
from bapo_megatron.models.spec import ModelSpec


class ToyMtp(Qwen3):
    name = "toy_mtp"
    architectures = ("ToyMtpForCausalLM",)

    def kept_tensors(self, spec: ModelSpec, hf: dict) -> KeptTensors:
        return extra_layers(hf)

    def tiny(self) -> ModelSpec:
        return ModelSpec(**tiny_fields(self.name), qkv_bias=False, qk_norm=True)


class ToyVL(Qwen3):
    name = "toy_vl_text"
    architectures = ("ToyVLForConditionalGeneration",)

    def disk_layout(self, hf: dict) -> DiskLayout:
        return nested_layout(hf)

    def kept_tensors(self, spec: ModelSpec, hf: dict) -> KeptTensors:
        return KeptTensors(("model.visual.",)) if "text_config" in hf else KeptTensors()

    def tiny(self) -> ModelSpec:
        return ModelSpec(**tiny_fields(self.name), qkv_bias=False, qk_norm=True)


def register() -> None:
    for family in (ToyMtp(), ToyVL()):
        FAMILIES[family.name] = family


VISION_CONFIG = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_position_embeddings": 16,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def released_qwen3_5(
    directory: Path, extra: dict[str, torch.Tensor] | None = None, tie: tuple[bool, bool] = (False, False)
) -> dict[str, torch.Tensor]:
    """transformers' own Qwen3_5ForConditionalGeneration of the Qwen3.5 family's tiny text model (and a
    tiny vision tower, one multi-token-prediction layer counted), saved, with an mtp.* tensor and
    `extra` added; `tie`: tie_word_embeddings at the top level and in text_config. Returns every
    tensor on disk."""
    import transformers
    from safetensors.torch import load_file, save_file

    family = FAMILIES["qwen3_5_text"]
    spec = family.tiny()
    text = {k: v for k, v in family.to_hf(spec).items() if k != "architectures"}
    text |= {"mtp_num_hidden_layers": 1, "tie_word_embeddings": tie[1]}
    vision = {**VISION_CONFIG, "out_hidden_size": spec.hidden_size}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie[0])
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(directory)
    (shard,) = directory.glob("*.safetensors")
    tensors = {**load_file(str(shard)), "mtp.fc.weight": torch.randn(8, 4).to(torch.bfloat16), **(extra or {})}
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return tensors


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return (torch.randn(shape, generator=g) * 0.1).to(dtype)


MTP_TENSORS = {  # name suffix -> (shape, dtype): DeepSeek-V3's MTP layer, a float8 weight with its scale among them
    "eh_proj.weight": ((64, 128), torch.bfloat16),
    "enorm.weight": ((64,), torch.bfloat16),
    "hnorm.weight": ((64,), torch.bfloat16),
    "mlp.down_proj.weight": ((64, 128), torch.float8_e4m3fn),
    "mlp.down_proj.weight_scale_inv": ((1, 1), torch.float32),
}
VISION_TENSORS = {
    "model.visual.patch_embed.proj.weight": ((32, 3, 2, 4, 4), torch.bfloat16),
    "model.visual.blocks.0.attn.qkv.weight": ((96, 32), torch.float32),
    "model.visual.merger.position_ids": ((16,), torch.int64),
}


def save_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 2) -> None:
    """config.json and `tensors` in `shards` safetensors files with an index."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names, weight_map = list(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def text_tensors(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 text-model tensors by canonical name."""
    g = torch.Generator().manual_seed(seed)
    return {name: _random(shape, torch.float32, g) for name, shape in expected_shapes(spec).items()}


def mtp_checkpoint(directory: Path, mtp_layers: int = 1, extra: dict[str, torch.Tensor] | None = None) -> dict:
    """A ToyMtp checkpoint with `mtp_layers` MTP layers after its 4; returns every tensor on disk."""
    family = FAMILIES[ToyMtp.name]
    spec = family.tiny()
    config = {**family.to_hf(spec), "num_nextn_predict_layers": mtp_layers, "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(7)
    tensors = text_tensors(spec, seed=1)
    for layer in range(spec.num_layers, spec.num_layers + mtp_layers):
        for suffix, (shape, dtype) in MTP_TENSORS.items():
            tensors[f"model.layers.{layer}.{suffix}"] = _random(shape, dtype, g)
    tensors.update(extra or {})
    save_checkpoint(directory, config, tensors)
    return tensors


def multimodal_config(spec: ModelSpec) -> dict:
    text = {**FAMILIES[ToyVL.name].to_hf(spec), "model_type": ToyVL.name}
    del text["architectures"], text["tie_word_embeddings"]
    return {
        "architectures": list(ToyVL.architectures),
        "model_type": "toy_vl",
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 32, "out_hidden_size": spec.hidden_size},
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": "float32",
    }


def multimodal_checkpoint(directory: Path, extra: dict[str, torch.Tensor] | None = None) -> dict:
    """A ToyVL checkpoint in the multimodal layout (text weights those of text_tensors(seed=2)); returns
    every tensor on disk."""
    spec = FAMILIES[ToyVL.name].tiny()
    g = torch.Generator().manual_seed(9)
    tensors = {MULTIMODAL_LAYOUT.disk_name(n): t for n, t in text_tensors(spec, seed=2).items()}
    tensors.update({name: _random(shape, dtype, g) for name, (shape, dtype) in VISION_TENSORS.items()})
    tensors.update(extra or {})
    save_checkpoint(directory, multimodal_config(spec), tensors)
    return tensors


def text_checkpoint(directory: Path) -> dict:
    """The same text model as multimodal_checkpoint's, in the text layout (no vision tower)."""
    family = FAMILIES[ToyVL.name]
    spec = family.tiny()
    tensors = text_tensors(spec, seed=2)
    save_checkpoint(directory, {**family.to_hf(spec), "torch_dtype": "float32"}, tensors)
    return tensors


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a HF directory's safetensors files, by name."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out
