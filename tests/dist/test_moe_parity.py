"""A Qwen3-MoE model trains at EP=2 (with data, tensor or pipeline parallel) as one process does,
with the engine's routes replayed (R3).

The tiny Qwen3-MoE (4 experts, top-2, a dense first layer) is made once at EP=1 and saved, with a
rollout batch whose samples carry random routes (each position's experts in each MoE layer, as an
engine would return them): random routes, unlike the model's own, show any slip in how a layout
slices them (sequence parallel's slices, pipeline stages' layers, expert-parallel ranks). Each
layout loads the model, takes one BAPO optimizer step replaying the routes, reports its metrics
(the router disagreement and expert load among them) and saves the updated weights; one process
then loads every result and compares it with the single-process run. That process also checks
replay itself: replaying the routes the model chooses gives exactly the step without replay, and
replaying others changes it. The EP=2 x DP=2 run also saves a full checkpoint (model, optimizer,
schedule) that resumes at EP=1 with the same weights and the same next step, and exports the
model to HF names live (experts gathered from both EP ranks), compared with the EP=1 export. The
layouts of one world size take turns in one launch.
"""

import json
from pathlib import Path

import pytest
import torch

from bapo_megatron.common.batch import RolloutBatch
from tests.dist.launch import each_layout, run_by_world, run_workers
from tests.families import own_routes
from tests.helpers import make_batch

# name: (tensor, pipeline, expert, processes)
LAYOUTS = {
    "ep1": (1, 1, 1, 1),
    "ep2": (1, 1, 2, 2),  # experts split over the two data-parallel ranks
    "tp2": (2, 1, 1, 2),  # every expert on both tensor-parallel ranks, sequence parallel
    "tp2ep2": (2, 1, 2, 2),  # experts split over the two tensor-parallel ranks, sequence parallel
    "pp2ep2": (1, 2, 2, 4),
}
COMPARED = (
    "loss/pg",
    "bapo/clip_low",
    "bapo/clip_high",
    "train/grad_norm",
    "policy/entropy",
    "moe/load_max",
    "moe/load/layer2",
    "moe/router_disagreement",
)


def _setup(tp: int, pp: int, ep: int, extra: tuple[str, ...] = ("algo.routing_replay=true",)):
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel

    activate_cpu_shim()
    overrides = [
        "algo.loss=bapo",
        "algo.bapo.target_rho=0.45",
        f"parallel.tensor={tp}",
        f"parallel.pipeline={pp}",
        f"parallel.expert={ep}",
        f"parallel.sequence_parallel={tp > 1}",
        "parallel.max_tokens_per_microbatch=48",
        "optimizer.lr=1e-3",
        "optimizer.adam_eps=1e-6",
        *extra,
    ]
    cfg = load_config(None, overrides)
    return tiny_spec("qwen3_moe"), cfg, init_model_parallel(cfg.parallel, cfg.seed)


def _make_weights(root: str) -> None:
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec, cfg, info = _setup(1, 1, 1)
    save_model(PolicyTrainer(spec, cfg, info).model, Path(root) / "init")
    batch = make_batch(0, max_len=14, temperature=0.9)
    g = torch.Generator().manual_seed(1)
    moe = spec.moe
    for sample in batch.samples:  # top-2 of 4 experts, distinct, per position and MoE layer
        scores = torch.rand(sample.length - 1, len(moe.sparse_layers), moe.num_experts, generator=g)
        sample.routes = scores.topk(moe.top_k, dim=-1).indices.to(torch.uint8)
    batch.save(Path(root) / "batch.safetensors")


def _export(trainer) -> dict[str, torch.Tensor]:
    from bapo_megatron.weights.gather import hf_buckets_to_rank0

    return {name: t.clone() for bucket in hf_buckets_to_rank0(trainer, 1 << 16) for name, t in bucket}


def _train_layouts(rank: int, world: int, root: str, names: tuple[str, ...]) -> None:
    """Each layout of `names` in turn; the one-process launch makes the weights and the batch first."""
    each_layout(world, names, lambda: _make_weights(root), lambda name: _train_layout(rank, root, name))


def _train_layout(rank: int, root: str, name: str) -> None:
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    tp, pp, ep, _ = LAYOUTS[name]
    batch = RolloutBatch.load(Path(root) / "batch.safetensors")
    spec, cfg, info = _setup(tp, pp, ep)
    trainer = PolicyTrainer(spec, cfg, info)
    trainer.load_weights(Path(root) / "init")
    result = trainer.train_step(batch)
    assert not result.skipped
    save_model(trainer.model, Path(root) / name)
    exported = _export(trainer)
    if name in ("ep1", "ep2"):
        CheckpointManager(CheckpointConfig(dir=str(Path(root) / f"full-{name}"))).save(trainer)
        second = trainer.train_step(batch).metrics  # the step a resumed run must repeat
        result.metrics["next/loss_pg"] = second["loss/pg"]
    if pp > 1:  # the schedule frees the tensors it backpropagates through, never the step's own loss tensors
        from functools import partial

        from bapo_megatron.trainer.policy_trainer import StepState

        mbs, _ = trainer.microbatches(batch)
        step = StepState(temperature=batch.temperature, first_update=True)
        outputs = trainer._run(mbs, partial(trainer._policy_loss, step), forward_only=False)
        assert all(out.loss_sum.dim() == 0 for out in outputs) and (outputs or not trainer.info.is_last_stage)
    if rank == 0:
        torch.save(exported, Path(root) / f"{name}-export.pt")
        (Path(root) / f"{name}.json").write_text(json.dumps(result.metrics))


def _replay_checks(root: str) -> None:
    """Replaying the model's own routes is the step without replay; replaying other routes is not."""
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    batch = RolloutBatch.load(Path(root) / "batch.safetensors")
    random_routes = [s.routes for s in batch.samples]
    spec, cfg, info = _setup(1, 1, 1)
    trainer = PolicyTrainer(spec, cfg, info)
    trainer.load_weights(Path(root) / "init")
    own = own_routes(trainer, batch)
    results = {}
    for name, routes in (("none", [None] * len(batch)), ("own", own), ("random", random_routes)):
        for sample, r in zip(batch.samples, routes, strict=True):
            sample.routes = r
        trainer.load_weights(Path(root) / "init")
        results[name] = trainer.train_step(batch).metrics
    assert results["own"]["loss/pg"] == results["none"]["loss/pg"]
    assert results["own"]["train/grad_norm"] == results["none"]["train/grad_norm"]
    assert results["own"]["moe/router_disagreement"] == 0.0 and "moe/router_disagreement" not in results["none"]
    assert results["random"]["loss/pg"] != results["none"]["loss/pg"]
    assert results["random"]["moe/router_disagreement"] > 0.2  # random top-2 of 4 against the router's
    assert "moe/aux_loss" not in results["none"]  # off by default


def _router_options(root: str) -> None:
    """model.moe: the auxiliary loss reported when on; frozen routers keep their weights."""
    from megatron.core import parallel_state as ps

    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    batch = RolloutBatch.load(Path(root) / "batch.safetensors")
    ps.destroy_model_parallel()
    spec, cfg, info = _setup(1, 1, 1, ("model.moe.aux_loss_coeff=0.01", "model.moe.freeze_router=true"))
    trainer = PolicyTrainer(spec, cfg, info)
    trainer.load_weights(Path(root) / "init")
    state = trainer.model[0].module.state_dict()
    before = {k: v.clone() for k, v in state.items() if k.endswith("router.weight")}
    assert not any(p.requires_grad for n, p in trainer.model[0].named_parameters() if "router" in n)
    metrics = trainer.train_step(batch).metrics
    assert metrics["moe/aux_loss"] > 0
    assert before and all(torch.equal(state[k], v) for k, v in before.items())
    expert = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"
    assert not torch.equal(state[expert], _initial(root, expert))  # the rest trains


def _initial(root: str, key: str) -> torch.Tensor:
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    trainer = PolicyTrainer(*_setup(1, 1, 1))
    trainer.load_weights(Path(root) / "init")
    return trainer.model[0].module.state_dict()[key].clone()


def _compare(root: str) -> None:
    from bapo_megatron.config import CheckpointConfig
    from bapo_megatron.trainer.checkpoint import CheckpointManager
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec, cfg, info = _setup(1, 1, 1)
    trainer = PolicyTrainer(spec, cfg, info)

    def weights(directory: str) -> dict[str, torch.Tensor]:
        trainer.load_weights(Path(root) / directory)
        state = trainer.model[0].module.state_dict()
        return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}

    initial, want = weights("init"), weights("ep1")
    moved = [k for k in want if not torch.equal(want[k], initial[k])]
    assert any(".local_experts." in k for k in moved) and any("router" in k for k in moved), "experts and routers train"
    for name in LAYOUTS:
        got = weights(name)
        worst = max((torch.linalg.norm(t - want[k]) / torch.linalg.norm(want[k])).item() for k, t in got.items())
        assert worst <= 1e-5, f"{name}: updated weights differ by {worst:.3g} (relative norm)"
    # The EP=2 checkpoint resumes at EP=1: the same weights and the same next step.
    batch = RolloutBatch.load(Path(root) / "batch.safetensors")
    resumed = PolicyTrainer(spec, cfg, info)
    assert CheckpointManager(CheckpointConfig(dir=str(Path(root) / "full-ep2"))).load(resumed) == 1
    ep2 = weights("ep2")
    for key, tensor in resumed.model[0].module.state_dict().items():
        if key in ep2:
            assert torch.equal(tensor, ep2[key]), key
    next_pg = resumed.train_step(batch).metrics["loss/pg"]
    expected = json.loads((Path(root) / "ep2.json").read_text())["next/loss_pg"]
    assert next_pg == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # The live exports (experts gathered over EP ranks) are the single process's, under per-expert HF names.
    single = torch.load(Path(root) / "ep1-export.pt")
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in single and "model.layers.0.mlp.gate_proj.weight" in single
    for name in LAYOUTS:
        exported = torch.load(Path(root) / f"{name}-export.pt")
        assert list(exported) == list(single), name
        for key, tensor in exported.items():  # as the updated weights above: a layout's sums round otherwise
            gap = (torch.linalg.norm(tensor - single[key]) / torch.linalg.norm(single[key])).item()
            assert gap <= 1e-5, f"{name} {key}: exported weights differ by {gap:.3g} (relative norm)"


def test_expert_parallel_layouts_match_single_process(tmp_path):
    root = str(tmp_path)
    run_by_world(_train_layouts, {name: world for name, (*_, world) in LAYOUTS.items()}, root)
    metrics = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in LAYOUTS}
    want = metrics["ep1"]
    assert want["bapo/search_steps"] > 0
    for name in LAYOUTS:
        for key in COMPARED:
            assert metrics[name][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (name, key)
    assert metrics["ep2"]["next/loss_pg"] == pytest.approx(want["next/loss_pg"], rel=1e-5, abs=1e-7)
    run_workers(_compare_and_replay, 1, root)


def _compare_and_replay(rank: int, world: int, root: str) -> None:
    _compare(root)
    _replay_checks(root)
    _router_options(root)
