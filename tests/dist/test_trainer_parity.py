"""TP=2, TP=2 with sequence parallel, PP=2, DP=2, TP=2 x PP=2 and PP=2 x VPP=2 train exactly as one
process does (gloo, CPU).

The weights are made once at TP=1 and saved as a dist checkpoint; every layout loads them,
takes one optimizer step on the same replayed rollout batch with BAPO (bound_scope "step")
and with ppo, reports its metrics and saves the updated weights; one TP=1 process then
loads every result and compares it with the single-process run. The layouts of one world size
take turns in one launch.
"""

import json
from pathlib import Path

import pytest
import torch

from bapo_megatron.common.batch import RolloutBatch
from tests.dist.launch import each_layout, run_by_world, run_workers
from tests.helpers import make_batch

pytestmark = pytest.mark.slow  # the longest of the tier: `make test-fast` leaves it out

LOSSES = ("bapo", "ppo")
# name: (tensor, pipeline, virtual pipeline, processes); "sp": sequence parallel
LAYOUTS = {
    "tp1": (1, 1, None, 1),
    "tp2": (2, 1, None, 2),
    "tp2sp": (2, 1, None, 2),
    "pp2": (1, 2, None, 2),
    "dp2": (1, 1, None, 2),
    "tp2pp2": (2, 2, None, 4),
    # the interleaved schedule, with micro-batches of unequal lengths in the batch
    "pp2vpp2": (1, 2, 2, 2),
}
COMPARED = (
    "loss/pg",
    "bapo/clip_low",
    "bapo/clip_high",
    "bapo/rho",
    "bapo/rho_start",
    "train/grad_norm",
    "policy/entropy",
    "policy/ratio_mean",
    "rollout_corr/train_rollout_logprob_abs_diff",
)


def _overrides(loss: str, tp: int, pp: int, vpp: int | None = None, sp: bool = False) -> list[str]:
    return [
        f"parallel.sequence_parallel={sp}",
        f"parallel.virtual_pipeline={'null' if vpp is None else vpp}",
        f"algo.loss={loss}",
        "algo.bapo.target_rho=0.45",
        f"parallel.tensor={tp}",
        f"parallel.pipeline={pp}",
        "parallel.max_tokens_per_microbatch=48",
        "optimizer.lr=1e-3",
        "optimizer.clip_grad=1.0",
        # Adam's first step is lr * g / (|g| + eps): at eps=1e-8 a gradient element of ~1e-8 turns
        # float32 summation-order noise (~1e-12) into a visible update. 1e-6 keeps the comparison
        # well-conditioned without changing what is compared.
        "optimizer.adam_eps=1e-6",
    ]


def _batch() -> RolloutBatch:
    return make_batch(0, max_len=14, temperature=0.9)


def _setup(tp: int, pp: int, loss: str = "bapo", vpp: int | None = None, sp: bool = False):
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel

    activate_cpu_shim()
    cfg = load_config(None, _overrides(loss, tp, pp, vpp, sp))
    return tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed)


def _make_weights(root: str) -> None:
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec, cfg, info = _setup(1, 1)
    save_model(PolicyTrainer(spec, cfg, info).model, Path(root) / "init")
    _batch().save(Path(root) / "batch.safetensors")


def _train_layouts(rank: int, world: int, root: str, names: tuple[str, ...]) -> None:
    """Each layout of `names` in turn; the one-process launch makes the weights and the batch first."""
    each_layout(world, names, lambda: _make_weights(root), lambda name: _train_layout(rank, root, name))


def _train_layout(rank: int, root: str, name: str) -> None:
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    tp, pp, vpp, _ = LAYOUTS[name]
    batch = RolloutBatch.load(Path(root) / "batch.safetensors")
    results = {}
    for loss in LOSSES:
        spec, cfg, info = _setup(tp, pp, loss, vpp, sp=name.endswith("sp"))
        trainer = PolicyTrainer(spec, cfg, info)
        trainer.load_weights(Path(root) / "init")
        result = trainer.train_step(batch)
        assert not result.skipped
        results[loss] = result.metrics
        save_model(trainer.model, Path(root) / f"{name}-{loss}")
        if name == "tp2" and loss == "bapo":  # a full checkpoint, to be resumed at TP=1
            CheckpointManager(CheckpointConfig(dir=str(Path(root) / "full-tp2"))).save(trainer)
    if rank == 0:
        (Path(root) / f"{name}.json").write_text(json.dumps(results))


def _compare(rank: int, world: int, root: str) -> None:
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec, cfg, info = _setup(1, 1)
    trainer = PolicyTrainer(spec, cfg, info)
    weights = {}
    for name in LAYOUTS:
        for loss in LOSSES:
            trainer.load_weights(Path(root) / f"{name}-{loss}")
            weights[name, loss] = {
                k: v.clone()
                for k, v in trainer.model[0].module.state_dict().items()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            }
    # The full TP=2 checkpoint (model, optimizer, schedule) resumes at TP=1, weights intact.
    resumed = PolicyTrainer(spec, cfg, info)
    assert CheckpointManager(CheckpointConfig(dir=str(Path(root) / "full-tp2"))).load(resumed) == 1
    for key, tensor in resumed.model[0].module.state_dict().items():
        if key in weights["tp2", "bapo"]:
            assert torch.equal(tensor, weights["tp2", "bapo"][key]), key
    trainer.load_weights(Path(root) / "init")
    initial = {k: v.clone() for k, v in trainer.model[0].module.state_dict().items() if k in weights["tp1", "bapo"]}
    for loss in LOSSES:
        want = weights["tp1", loss]
        assert any(not torch.equal(want[k], initial[k]) for k in want), "the step changed nothing"
        for name in LAYOUTS:
            worst = max(
                (torch.linalg.norm(t - want[k]) / torch.linalg.norm(want[k]).clamp(min=1e-12)).item()
                for k, t in weights[name, loss].items()
            )
            print(f"{name} {loss}: worst tensor relative difference {worst:.2e}")
            assert worst <= 1e-5, f"{name} {loss}: updated weights differ by {worst:.3g} (relative norm)"


@pytest.mark.slow
def test_layouts_match_single_process(tmp_path):
    root = str(tmp_path)
    run_by_world(_train_layouts, {name: world for name, (*_, world) in LAYOUTS.items()}, root)
    metrics = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in LAYOUTS}
    for loss in LOSSES:
        want = metrics["tp1"][loss]
        if loss == "bapo":
            assert want["bapo/search_steps"] > 0  # the search moved: the bounds are a real check
        for name in LAYOUTS:
            got = metrics[name][loss]
            for key in COMPARED:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, loss, key)
    run_workers(_compare, 1, root)
