"""Tiny quantized releases for the tests, made as their releases store them: a DeepSeek-V3 in fp8
block scales (blocks that leave partial edge blocks, as DeepSeek-V3's 576-row kv_a_proj_with_mqa
does, and blocks that tile every tensor) and a gpt-oss with MXFP4 experts."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bapo_megatron.models import family_of
from tests.helpers import make_hf_model

BLOCK = (16, 16)
"""Blocks of the tiny releases: kv_a_proj_with_mqa's 40 rows end in a partial one, as DeepSeek-V3's 576 do."""
TILED = (8, 8)
"""Blocks that tile every tensor of the tiny DeepSeek-V3: transformers 5.24's loader refuses partial blocks."""
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "embed_tokens", "lm_head"]}
MTP = "model.layers.4."
"""The tiny DeepSeek-V3 release's multi-token-prediction layer (kept, not trained), fp8 as the decoder's."""


def reference_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A release's quantizer, block by block: scale = amax / 448, codes = weight / scale."""
    rows, cols = weight.shape
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            part = (slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1]))
            scales[i, j] = weight[part].abs().max() / 448
            codes[part] = (weight[part] / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def _releases_fp8(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3's release: every linear weight of the decoder in fp8 but the router's."""
    return name.startswith("model.layers.") and tensor.dim() == 2 and not name.endswith("mlp.gate.weight")


def all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def rewrite(directory: Path, tensors: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    """`directory`'s weights replaced by `tensors` in one file, its config's quantization_config by
    `quantization` (None: none)."""
    for file in [*directory.glob("*.safetensors"), *directory.glob("*.index.json")]:
        file.unlink()
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _add_mtp_layer(directory: Path) -> None:
    """Layer 3's tensors again as a multi-token-prediction layer after the decoder (num_nextn_predict_layers 1)."""
    tensors = load_file(str(directory / "model.safetensors"))
    tensors |= {
        n.replace("model.layers.3.", MTP): t.clone() for n, t in tensors.items() if n.startswith("model.layers.3.")
    }
    save_file(tensors, str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))


def fp8_release(source: Path, directory: Path, block: tuple[int, int]) -> Path:
    """A copy of the unquantized HF model `source` as its fp8 release stores it: every linear weight of
    the decoder but the router's in fp8 codes and float32 block scales (reference_fp8), the rest bf16
    (tensors the family keeps in float32 so)."""
    shutil.copytree(source, directory)
    config = json.loads((source / "config.json").read_text())
    family, fp8 = family_of(config["model_type"]), {}
    for key, tensor in all_tensors(source).items():
        if _releases_fp8(key, tensor):
            fp8[key], fp8[key.removesuffix("weight") + "weight_scale_inv"] = reference_fp8(tensor, block)
        else:  # the expert bias in float32, as DeepSeek-V3's release and Megatron keep it
            fp8[key] = tensor if family.float32_tensor(key) else tensor.bfloat16()
    return rewrite(directory, fp8, {**FP8, "weight_block_size": list(block)})


def make_releases(root: Path) -> Path:
    """Under `root`: the tiny models unquantized (deepseek, gpt_oss) and their releases, copies of them
    quantized as released: deepseek-fp8 (BLOCK, partial edge blocks, an MTP layer), deepseek-fp8-tiled
    (TILED), gpt_oss-mxfp4 (random codes)."""
    make_hf_model(root, "deepseek", ("deepseek_v3", 4, False))
    make_hf_model(root, "gpt_oss", ("gpt_oss", 2, False))
    for name, block in (("deepseek-fp8", BLOCK), ("deepseek-fp8-tiled", TILED)):
        fp8_release(root / "deepseek", root / name, block)
    _add_mtp_layer(root / "deepseek-fp8")
    shutil.copytree(root / "gpt_oss", root / "gpt_oss-mxfp4")
    g, mx = torch.Generator().manual_seed(5), {}
    for name, tensor in all_tensors(root / "gpt_oss").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, cols, rows = tensor.shape  # [experts, in, out]
            mx[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g).to(torch.uint8)
            mx[name + "_scales"] = torch.randint(118, 126, (experts, rows, cols // 32), generator=g).to(torch.uint8)
        else:
            mx[name] = tensor.bfloat16()
    rewrite(root / "gpt_oss-mxfp4", mx, MXFP4)
    return root
