"""On a Hopper GPU with Transformer Engine: one BAPO step in bf16 and in fp8 agree.

Both runs start from the same weights (saved once as a dist checkpoint) and train on the
same replayed batch; fp8 (tensorwise scaling, first/last layers in bf16) must give the same
loss and BAPO bounds as bf16 within fp8's precision.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None,
    reason="needs CUDA and Transformer Engine",
)


def _trainer(precision: str):
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    cfg = load_config(
        None,
        [
            "model.transformer_impl=transformer_engine",
            f"model.precision={precision}",
            "parallel.max_tokens_per_microbatch=256",
            "optimizer.lr=1e-4",
        ],
    )
    return PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))


def _worker(rank: int, world: int, root: str) -> None:
    import json

    from bapo_megatron.trainer.dist_ckpt import load_model, save_model

    save_model(_trainer("bf16").model, Path(root) / "init")
    results = {}
    for precision in ("bf16", "fp8"):
        trainer = _trainer(precision)
        load_model(trainer.model, Path(root) / "init")
        result = trainer.train_step(make_batch(3))
        assert not result.skipped
        results[precision] = result.metrics
    (Path(root) / "metrics.json").write_text(json.dumps(results))


def test_bf16_and_fp8_steps_agree(tmp_path):
    import json

    run_workers(_worker, 1, str(tmp_path), device="cuda")
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["fp8"]["loss/pg"] == pytest.approx(m["bf16"]["loss/pg"], rel=5e-2, abs=5e-3)
    assert m["fp8"]["policy/entropy"] == pytest.approx(m["bf16"]["policy/entropy"], rel=2e-2)
    assert m["fp8"]["train/grad_norm"] == pytest.approx(m["bf16"]["train/grad_norm"], rel=1e-1)
