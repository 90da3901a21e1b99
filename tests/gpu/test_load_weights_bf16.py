"""bf16 parameters: weights loaded into a live trainer reach the optimizer's fp32 main copies
(Megatron's reload_model_params), so the next step starts from them (tests/dist/test_load_weights.py
has the scheme; without the refresh the step writes the old values back)."""

import pytest

from tests.dist.launch import run_workers
from tests.dist.test_load_weights import load_then_step


def _gpu(rank: int, world: int, root: str) -> None:
    load_then_step(root, "bf16", 1)


@pytest.mark.gpu
def test_bf16_main_parameters_follow_loaded_weights(tmp_path):
    run_workers(_gpu, 1, str(tmp_path), device="cuda")
