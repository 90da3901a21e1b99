"""A LoRA run on a quantized release (a tiny Qwen3 "-FP8"), its adapters alone merged onto that base by
mcore-to-hf (weights/lora_merge.py): written in the release's layout, each weight's fp8 codes and
block scales our quantizer's of its merged float32 values (bitwise), within fp8's rounding of them,
quantization_config kept, loaded by transformers as we read it; with dequantized, the merged weights
themselves and no quantization_config."""

import json
from pathlib import Path

import torch

from tests.dist.launch import run_workers

CASE = ("qwen3", 2, False)
BLOCK = (16, 16)
"""Blocks that tile every weight of the tiny Qwen3 (transformers' fp8 loader refuses partial ones)."""


def _adapters_alone(release: Path, root: Path) -> Path:
    """A LoRA step on `release` (the adapters moved off zero), saved without its base."""
    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.config import dump_config, load_config
    from bapo_megatron.config.run import CheckpointConfig
    from bapo_megatron.trainer.base_identity import identify_base
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer
    from tests.helpers import make_batch

    overrides = [f"model.hf_path={release}", "model.lora.rank=4", "model.lora.alpha=8", "optimizer.lr=5e-2"]
    cfg = load_config(None, [*overrides, "parallel.max_tokens_per_microbatch=48"])
    trainer = PolicyTrainer(HFCheckpoint(release).spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
    load_hf_into_trainer(trainer, release)
    identify_base(trainer, "model.hf_path", release)
    trainer.train_step(make_batch(0))
    manager = CheckpointManager(CheckpointConfig(dir=str(root / "ckpt")), dump_config(cfg))
    manager.without_base = True
    return manager.save(trainer)


def _worker(rank: int, world: int, hf_dir: str, tmp: str) -> None:
    import transformers

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.models.quantized import fp8_dequantize, fp8_quantize
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.weights.convert import mcore_to_hf
    from tests.quantized_releases import all_tensors, fp8_release

    activate_cpu_shim()
    root = Path(tmp)
    release = fp8_release(Path(hf_dir), root / "release", BLOCK)
    alone = _adapters_alone(release, root)
    merged = all_tensors(mcore_to_hf(alone, root / "plain", dtype="float32", progress=False, dequantized=True))
    out = mcore_to_hf(alone, root / "fp8", dtype="bfloat16", progress=False)
    ours, theirs, base = all_tensors(out), all_tensors(release), HFCheckpoint(release)
    assert (
        json.loads((out / "config.json").read_text())["quantization_config"]
        == json.loads((release / "config.json").read_text())["quantization_config"]
    )
    assert "quantization_config" not in json.loads((root / "plain" / "config.json").read_text())
    assert sorted(ours) == sorted(theirs) and all(ours[n].dtype == t.dtype for n, t in theirs.items())
    adapted = [n for n in base.files if not torch.equal(merged[n], base[n].float())]
    assert "model.layers.0.self_attn.q_proj.weight" in adapted and "model.layers.1.mlp.down_proj.weight" in adapted
    for name, tensor in merged.items():
        if ours[name].dtype != torch.float8_e4m3fn:
            continue
        scale = ours[name.removesuffix("weight") + "weight_scale_inv"]
        codes, want = fp8_quantize(tensor, BLOCK)
        assert torch.equal(ours[name].view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scale, want), name
        error = (fp8_dequantize(ours[name], scale, BLOCK) - tensor).abs()
        assert (error <= tensor.abs() * 2.0**-4 + scale.max() * 2.0**-9).all(), name  # e4m3: 3 mantissa bits
        if name not in adapted:  # the release's own codes come back
            assert torch.equal(ours[name].view(torch.uint8), theirs[name].view(torch.uint8)), name
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    loaded, read = model.state_dict(), HFCheckpoint(out)
    assert all(torch.equal(loaded[name], read[name].float()) for name in read.files if name in loaded)
    assert all(name in loaded for name in adapted)


def test_a_lora_merge_onto_an_fp8_release_is_written_as_released(hf_model, tmp_path):
    run_workers(_worker, 1, str(hf_model("lora-fp8-base", CASE)), str(tmp_path))
