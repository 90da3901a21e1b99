"""On a GPU with Transformer Engine: packed micro-batches as THD rows (cu_seqlens, TE's fused RoPE
restarting at each sample) give the padded path's log-probs, within bf16's precision: both in bf16
are compared with the local spec's padded path in float32 (the reference), and the packed error
must be no larger than twice the padded one's (the same weights, other kernels and shapes). The
dense model and the tiny Qwen3-MoE (grouped GEMM) both; the CPU counterpart, the masked row, is
tests/dist/test_packing.py."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.dist.test_packing import token_logprobs
from tests.helpers import CASES, make_batch, make_hf_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs CUDA and Transformer Engine",
)
MODELS = {"qwen2-gqa2": CASES["qwen2-gqa2"], "qwen3-moe": ("qwen3_moe", 2, False)}


def _worker(rank: int, world: int, root: str, name: str) -> None:
    import dataclasses

    from bapo_megatron.common.model_spec import tiny_spec
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.packing import ThdAttention
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    arch, kv, tied = MODELS[name]
    spec = dataclasses.replace(tiny_spec(arch), num_kv_heads=kv, tie_embeddings=tied)
    make_hf_model(Path(root), name, MODELS[name])
    batch = make_batch(5, groups=4, n=4, max_len=40)
    out = {}
    runs = {
        "reference": ("local", "fp32", "padded"),
        "padded": ("transformer_engine", "bf16", "padded"),
        "packed": ("transformer_engine", "bf16", "auto"),  # auto packs with TE
    }
    for label, (impl, precision, packing) in runs.items():
        cfg = load_config(
            None,
            [
                f"model.transformer_impl={impl}",
                f"model.precision={precision}",
                f"parallel.packing={packing}",
                "parallel.max_tokens_per_microbatch=256",
            ],
        )
        trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        assert (trainer.layout.attention == ThdAttention()) == (label == "packed")
        load_hf_into_trainer(trainer, Path(root) / name)
        found = token_logprobs(trainer, batch)
        out[label] = torch.cat([found[i][0].float().cpu() for i in sorted(found)]).tolist()
        del trainer
    (Path(root) / "logprobs.json").write_text(json.dumps(out))


@pytest.mark.parametrize("name", list(MODELS))
def test_thd_rows_give_the_padded_logprobs(tmp_path, name):
    run_workers(_worker, 1, str(tmp_path), name, device="cuda")
    got = {k: torch.tensor(v) for k, v in json.loads((tmp_path / "logprobs.json").read_text()).items()}
    padded_err = (got["padded"] - got["reference"]).abs()
    packed_err = (got["packed"] - got["reference"]).abs()
    print(f"{name}: padded bf16 max err {padded_err.max():.3g}, packed (THD) max err {packed_err.max():.3g}")
    assert packed_err.mean() <= 2 * padded_err.mean() + 1e-3
    assert packed_err.max() <= 2 * padded_err.max() + 1e-2
