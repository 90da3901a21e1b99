"""An SGLang server started from a quantized release holds its weights as released (fp8 codes and
block scales, MXFP4 experts): the engine memory estimate (trainer/memory/engine.engine_weight_bytes)
counts those bytes, not bf16's, and the dry run says so."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from bapo_megatron.common.hf_io import TORCH_DTYPES, HFCheckpoint, expected_shapes
from bapo_megatron.models.quantized import Quantization, read_quantization
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.memory.engine import engine_weight_bytes
from tests.quantized_releases import MTP, make_releases

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    return make_releases(tmp_path_factory.mktemp("releases"))


def _bytes_on_disk(directory: Path) -> int:
    """The release's text model as stored: what one SGLang rank at TP 1 loads (the multi-token
    prediction layer aside: SGLang serves it only for speculative decoding)."""
    total = 0
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = f.keys()
        for name in names:
            if not name.startswith(MTP):
                tensor = f.get_slice(name)
                total += math.prod(tensor.get_shape()) * TORCH_DTYPES[tensor.get_dtype()].itemsize
    return total


@pytest.mark.parametrize("name", ["deepseek-fp8", "deepseek-fp8-tiled", "gpt_oss-mxfp4"])
def test_one_rank_holds_the_release_as_stored(releases, name):
    """At TP 1 a server holds the release's bytes: fp8 codes, float32 scales of whole and partial
    blocks, MXFP4 blocks and E8M0 scales, the rest bf16 (the expert bias float32)."""
    release = HFCheckpoint(releases / name)
    quantization = read_quantization(release.config)
    assert engine_weight_bytes(release.spec, 1, quantization) == _bytes_on_disk(releases / name)
    assert engine_weight_bytes(release.spec, 1, None) > 1.6 * _bytes_on_disk(releases / name)


def _numel(spec: ModelSpec, kind) -> list[tuple[int, ...]]:
    return [shape for name, shape in expected_shapes(spec).items() if kind(name, shape)]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_hand_count_of_the_quantized_weights(releases, tp):
    """fp8 in 16x16 blocks: each quantized weight 1 byte instead of 2, plus 4 bytes a block (40 rows:
    3 blocks); MXFP4: 4 bits and 1/32 byte a weight; split over the TP ranks."""
    spec = HFCheckpoint(releases / "deepseek-fp8").spec
    fp8 = Quantization("fp8", (16, 16))
    linear = _numel(spec, lambda n, s: n.startswith("model.layers.") and len(s) == 2 and ".mlp.gate." not in n)
    saved = sum(r * c - 4 * math.ceil(r / 16) * math.ceil(c / 16) for r, c in linear)
    assert engine_weight_bytes(spec, tp, fp8) == engine_weight_bytes(spec, tp, None) - saved // tp
    spec = HFCheckpoint(releases / "gpt_oss-mxfp4").spec
    experts = sum(math.prod(s) for s in _numel(spec, lambda n, s: ".mlp.experts." in n and len(s) == 3))
    mx = Quantization("mxfp4")
    assert (
        engine_weight_bytes(spec, tp, mx)
        == engine_weight_bytes(spec, tp, None) - (2 * experts - experts * 17 // 32) // tp
    )


def test_the_dry_run_counts_an_fp8_releases_engine_weights(tmp_path, capsys, monkeypatch):
    """Moonlight's shape as an fp8 release (128x128 blocks, as DeepSeek-V3's): the SGLang line's
    weights are about half bf16's and say how they are counted."""
    from bapo_megatron.train import main

    shape = shutil.copytree(EXAMPLES / "moonlight-16b-a3b" / "shape", tmp_path / "shape")
    config = json.loads((shape / "config.json").read_text())
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (shape / "config.json").write_text(json.dumps({**config, "quantization_config": fp8}))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    figures = {}
    for directory in (EXAMPLES / "moonlight-16b-a3b" / "shape", shape):
        main(["examples/moonlight-16b-a3b/config.yaml", "--dry-run", "--world-size=8", f"model.hf_path={directory}"])
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("each SGLang server GPU"))
        figures[directory] = (float(re.search(r"weights ([\d.]+) GiB", line).group(1)), line)
    (bf16, plain), (ours, said) = figures.values()
    spec = ModelSpec.from_hf_dir(shape)
    assert ours == round(
        engine_weight_bytes(spec, 2, read_quantization(json.loads((shape / "config.json").read_text()))) / 2**30, 2
    )
    assert 0.5 < ours / bf16 < 0.6 and "fp8" not in plain
    assert "as the release stores them: fp8, 1 byte a weight and a float32 scale a 128x128 block" in said
