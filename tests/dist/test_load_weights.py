"""Weights loaded into a live trainer are the weights it trains from.

Scheme (the same on CPU here and on a GPU in tests/gpu/test_load_weights_bf16.py): the trainer's
parameters are moved away from what its optimizer holds (+1), saved, and loaded back through
PolicyTrainer.load_weights; a step at a negligible learning rate must then leave the loaded
values, not the optimizer's older copy. With fp32 parameters (here) the optimizer steps the
parameters themselves; with bf16 it steps fp32 main copies, which load_weights must refresh
(Megatron's reload_model_params, spied on here: the GPU test checks what it does).
"""

import pytest
import torch

from tests.dist.launch import run_workers


def load_then_step(root: str, precision: str, tp: int) -> None:
    from pathlib import Path

    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from tests.helpers import make_batch

    cfg = load_config(
        None,
        [
            f"model.precision={precision}",
            f"parallel.tensor={tp}",
            "optimizer.lr=1e-12",
            "parallel.max_tokens_per_microbatch=64",
        ],
    )
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    params = list(trainer.model[0].module.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(1.0)  # the optimizer's copy (if it keeps one) still holds the old values
    save_model(trainer.model, Path(root) / "moved")
    loaded = [p.detach().clone() for p in params]
    calls = []
    reload = trainer.optimizer.reload_model_params
    trainer.optimizer.reload_model_params = lambda *a, **k: (calls.append(1), reload(*a, **k))[1]
    trainer.load_weights(Path(root) / "moved")
    assert calls == [1]
    result = trainer.train_step(make_batch(3))
    assert not result.skipped
    for p, want in zip(params, loaded, strict=True):
        torch.testing.assert_close(p.detach().float(), want.float(), rtol=0, atol=1e-3)


def _cpu(rank: int, world: int, root: str) -> None:
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()
    load_then_step(root, "fp32", world)


@pytest.mark.dist
def test_loaded_weights_are_what_the_next_step_starts_from(tmp_path):
    run_workers(_cpu, 2, str(tmp_path))
