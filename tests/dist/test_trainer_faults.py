"""A non-finite input or gradient skips the step on every rank: no hang, no NaN in the weights."""

import math
import warnings

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch


def _worker(rank: int, world: int, loss: str, scope: str, tp: int, pp: int) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    cfg = load_config(
        None,
        [
            f"algo.loss={loss}",
            f"algo.bapo.bound_scope={scope}",
            f"parallel.tensor={tp}",
            f"parallel.pipeline={pp}",
            "parallel.max_tokens_per_microbatch=64",
        ],
    )
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    before = {k: v.clone() for k, v in trainer.model[0].module.state_dict().items() if isinstance(v, torch.Tensor)}
    poisoned = make_batch(7)
    poisoned.samples[5].behaviour_logprobs[0] = math.nan  # a counted token
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.train_step(poisoned)
    if loss == "bapo" and trainer.info.is_last_stage:  # where the search ran, it said why
        assert any("will be skipped" in str(w.message) for w in caught)
    assert result.skipped and result.metrics["train/skipped"] == 1.0 and trainer.step == 0
    after = trainer.model[0].module.state_dict()
    for key, tensor in before.items():
        assert torch.equal(tensor, after[key]), key  # nothing written
    clean = trainer.train_step(make_batch(8))
    assert not clean.skipped and trainer.step == 1
    assert all(torch.isfinite(p).all() for p in trainer.model[0].module.parameters())


@pytest.mark.parametrize(
    ("loss", "scope", "tp", "pp", "world"),
    [
        ("bapo", "step", 1, 2, 2),  # the search after the forward-only pass, on the last stage only
        ("bapo", "microbatch", 1, 1, 2),  # the search inside the loss, over the data-parallel group
        ("ppo", "step", 2, 1, 2),  # no search: the non-finite loss and gradients are caught
    ],
)
def test_nonfinite_steps_are_skipped_everywhere(loss, scope, tp, pp, world):
    run_workers(_worker, world, loss, scope, tp, pp)
