"""On a GPU with Transformer Engine: packed micro-batches as THD rows (cu_seqlens, TE's fused RoPE
restarting at each sample) give the padded path's log-probs, within bf16's precision: both in bf16
are compared with the local spec's padded path in float32 (the reference), and the packed error
must be no larger than twice the padded one's (the same weights, other kernels and shapes). The
dense model and the tiny Qwen3-MoE (grouped GEMM) both; the CPU counterpart, the masked row, is
tests/dist/test_packing.py."""

import importlib.util

import pytest
import torch

from tests.dist.launch import run_workers
from tests.gpu.test_te_logprobs import MODELS, logprobs_of_runs, read_runs

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs CUDA and Transformer Engine",
)
RUNS = {
    "reference": ["model.transformer_impl=local", "model.precision=fp32", "parallel.packing=padded"],
    "padded": ["model.transformer_impl=transformer_engine", "model.precision=bf16", "parallel.packing=padded"],
    "packed": ["model.transformer_impl=transformer_engine", "model.precision=bf16"],  # auto packs with TE
}


@pytest.mark.parametrize("name", list(MODELS))
def test_thd_rows_give_the_padded_logprobs(tmp_path, name):
    run_workers(logprobs_of_runs, 1, str(tmp_path), name, RUNS, device="cuda")
    got, attention = read_runs(tmp_path)
    assert attention == {"reference": "PaddedAttention", "padded": "PaddedAttention", "packed": "ThdAttention"}
    padded_err = (got["padded"] - got["reference"]).abs()
    packed_err = (got["packed"] - got["reference"]).abs()
    print(f"{name}: padded bf16 max err {padded_err.max():.3g}, packed (THD) max err {packed_err.max():.3g}")
    assert packed_err.mean() <= 2 * padded_err.mean() + 1e-3
    assert packed_err.max() <= 2 * padded_err.max() + 1e-2
