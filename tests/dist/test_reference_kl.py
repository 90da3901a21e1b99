"""The KL loss to a reference model (algo.kl_coef) and the entropy bonus (algo.entropy_coef) in the
trainer: the reference holds the starting weights, so the first step's KL is 0 and the next one's is
not; the step's loss is the policy term plus kl_coef x KL minus entropy_coef x entropy, token means
over the same tokens; a checkpoint keeps the reference, so a resumed trainer measures its KL to the
run's starting weights (not to the weights it resumed) and takes the step the first would have
taken; a checkpoint without a reference is refused by a trainer with a KL loss, and a trainer
without one loads a checkpoint that has it. One process, the tiny dense model, the CPU shim."""

from functools import partial
from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch

KL_COEF, ENTROPY_COEF = 0.5, 0.01
BASE = ["algo.loss=ppo", "optimizer.lr=1e-2", "parallel.max_tokens_per_microbatch=48"]
KL = [f"algo.kl_coef={KL_COEF}", f"algo.entropy_coef={ENTROPY_COEF}"]


def _weights(chunks) -> dict[str, torch.Tensor]:
    from bapo_megatron.trainer.dist_ckpt import unwrap

    state = unwrap(chunks[0]).state_dict()
    return {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _loss_parts(trainer, batch) -> tuple[float, dict[str, float]]:
    """The step's loss (summed loss over summed tokens) at the trainer's weights, and its metrics."""
    from bapo_megatron.algo.metrics import reduce_metrics
    from bapo_megatron.trainer.policy_trainer import StepState

    mbs, _ = trainer.microbatches(batch)
    step = StepState(temperature=batch.temperature, first_update=True)
    trainer._reference_pass(step, mbs)
    with torch.no_grad():
        outputs = trainer._run(mbs, partial(trainer._policy_loss, step), forward_only=True)
    total = sum(float(out.loss_sum) for out in outputs) / sum(float(out.token_count) for out in outputs)
    return total, reduce_metrics(outputs)


def _worker(rank: int, world: int, root: str) -> None:
    from bapo_megatron.config import CheckpointConfig, load_config
    from bapo_megatron.errors import ConfigError
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    spec, batch = tiny_spec("qwen2"), make_batch(2, max_len=14)
    cfg = load_config(None, [*BASE, *KL])
    info = init_model_parallel(cfg.parallel, cfg.seed)
    trainer = PolicyTrainer(spec, cfg, info)
    trainer.hold_reference()
    start = _weights(trainer.model)
    assert _same(_weights(trainer.reference.chunks), start)
    assert not any(p.requires_grad for chunk in trainer.reference.chunks for p in chunk.parameters())

    first = trainer.train_step(batch).metrics
    assert first["loss/kl"] == 0.0  # the policy is the reference: the same weights, the same log-probs
    total, parts = _loss_parts(trainer, batch)
    assert parts["loss/kl"] > 1e-6
    want = parts["loss/pg"] + KL_COEF * parts["loss/kl"] - ENTROPY_COEF * parts["policy/entropy"]
    assert total == pytest.approx(want, rel=1e-6)
    assert _same(_weights(trainer.reference.chunks), start)  # frozen: the step moved the policy only

    manager = CheckpointManager(CheckpointConfig(dir=str(Path(root) / "kl")))
    manager.save(trainer, 1)
    policy = _weights(trainer.model)
    resumed = PolicyTrainer(spec, cfg, info)  # built afresh: its own random weights until loaded
    assert manager.load(resumed) == 1
    assert _same(_weights(resumed.reference.chunks), start) and _same(_weights(resumed.model), policy)
    again, second = resumed.train_step(batch).metrics, trainer.train_step(batch).metrics
    assert again["loss/kl"] > 0 and again["loss/kl"] == pytest.approx(second["loss/kl"], rel=1e-6)
    assert again["loss/pg"] == pytest.approx(second["loss/pg"], rel=1e-6)

    plain_cfg = load_config(None, BASE)
    plain = PolicyTrainer(spec, plain_cfg, info)
    assert plain.reference is None
    manager.load(plain)  # the stored reference is not asked for
    CheckpointManager(CheckpointConfig(dir=str(Path(root) / "plain"))).save(plain, 1)
    with pytest.raises(ConfigError, match=r"algo\.kl_coef=0\.5: checkpoint .* holds no reference model"):
        CheckpointManager(CheckpointConfig(dir=str(Path(root) / "plain"))).load(PolicyTrainer(spec, cfg, info))


def test_kl_loss_to_the_starting_weights_and_its_resume(tmp_path):
    run_workers(_worker, 1, str(tmp_path))


def test_the_dry_run_counts_the_reference_model():
    """The estimate adds the reference's parameters (the stage's, in the parameters' dtype) with a KL
    loss, and the dry run says so; without one, nothing."""
    from bapo_megatron import cli
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.memory.estimate import trainer_memory

    spec, cfg = tiny_spec("qwen2"), load_config(None, ["algo.kl_coef=0.001"])
    off = trainer_memory(spec, cfg.model, cfg.parallel, 1)
    on = trainer_memory(spec, cfg.model, cfg.parallel, 1, reference=True)
    assert off.reference == 0 and on.reference == on.params > 0
    assert on.peak == off.peak + on.params and on.resident == off.resident + on.params
    assert "KL loss (algo.kl_coef): the reference model" in cli.dry_run(cfg, 1, 80 * cli.GIB)
    assert "KL loss" not in cli.dry_run(load_config(None, []), 1, 80 * cli.GIB)
