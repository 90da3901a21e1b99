"""With one micro-batch a rank, the prepass (pi_prox, BAPO's step bounds, batch normalisation's mean
weight) rides on the training forward: one model pass a step instead of two, and the step's loss,
gradient norm, metrics and weights after it bitwise those of the separate forward-only pass."""

from __future__ import annotations

import torch

RUNS = {
    "bapo": [],
    "ppo_decoupled_is": [
        "algo.loss=ppo",
        "algo.rollout_correction.rollout_is=token",
        "algo.rollout_correction.rollout_is_threshold=1.5",
        "algo.rollout_correction.rollout_is_batch_normalize=true",
    ],
}


def _step(overrides: list[str], fold: bool, max_tokens: int) -> tuple[dict, list[torch.Tensor], int]:
    """One step of a fresh trainer (the same seed: the same weights): metrics, weights after, passes."""
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from tests.helpers import make_batch

    cfg = load_config(None, [f"parallel.max_tokens_per_microbatch={max_tokens}", *overrides])
    trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
    if not fold:  # the old path: always the separate forward-only pass
        trainer._folds_prepass = lambda mbs: False
    passes = []
    run = trainer._run
    trainer._run = lambda mbs, *a, **kw: passes.append(a) or run(mbs, *a, **kw)
    metrics = trainer.train_step(make_batch(3)).metrics
    weights = [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()]
    return metrics, weights, len(passes)


def _worker(rank: int, world: int) -> None:
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()
    for name, overrides in RUNS.items():
        old_metrics, old_weights, old_passes = _step(overrides, fold=False, max_tokens=4096)
        metrics, weights, passes = _step(overrides, fold=True, max_tokens=4096)
        assert (old_passes, passes) == (2, 1), (name, old_passes, passes)
        assert metrics.keys() == old_metrics.keys(), name
        differ = {k: (old_metrics[k], v) for k, v in metrics.items() if not _same(v, old_metrics[k])}
        assert not differ, (name, differ)
        assert all(torch.equal(a, b) for a, b in zip(old_weights, weights, strict=True)), name
        assert metrics["train/grad_norm"] > 0 and metrics["train/skipped"] == 0.0, name
    # several micro-batches a rank: the step's search needs every table first, so the prepass stays
    assert _step([], fold=True, max_tokens=48)[2] == 2


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN figures (none expected) compare equal to themselves


def test_one_microbatch_folds_the_prepass_into_the_training_pass_bitwise():
    from tests.dist.launch import run_workers

    run_workers(_worker, 1)
