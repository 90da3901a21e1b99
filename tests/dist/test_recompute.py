"""Activation recompute (parallel.recompute) changes memory, not the step: one optimizer step with
selective and with full recompute gives the loss, gradient norm and updated weights of the step
without, for the tiny dense model and the tiny Qwen3-MoE, at pipeline 2 (two processes, the CPU
shim: stage 0 holds two micro-batches in flight). That the recompute happens is counted: the
recomputed modules run forward again in the backward pass (core attention under selective; a
recomputed layer's MLP under full, each stage's first layer only with recompute_layers=1).

The MoE model also replays the engine's routes (algo.routing_replay), random ones given to every
sample but one (whose micro-batch routes itself): a recomputed router must take again the routes
of the micro-batch being backpropagated, not those of the micro-batch that went forward last, so
the step with full recompute is the step without (loss, gradient norm, weights, router figures
counted once), and differs from the step without replay. A router keeps the routes of at most the
micro-batches in flight on its stage, and none once they have all been backpropagated.

At expert parallel 2 (two processes, pipeline 1) the replaying MoE model takes the same step with
full recompute as without: the recomputed layer's all-to-alls run again in its backward pass, with
the CPU shim's device mode still on."""

from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch

SETTINGS = {"none": [], "selective": ["parallel.recompute=selective"], "full": ["parallel.recompute=full"]}
SETTINGS["full-1"] = ["parallel.recompute=full", "parallel.recompute_layers=1"]
REPLAYED = {f"replay-{name}": [*SETTINGS[name], "algo.routing_replay=true"] for name in ("none", "full", "full-1")}
COMPARED = ("loss/pg", "train/grad_norm", "policy/entropy")
ROUTER_FIGURES = ("moe/load_max", "moe/router_disagreement")
BASE = ("optimizer.lr=1e-3", "optimizer.adam_eps=1e-6", "parallel.max_tokens_per_microbatch=48")


def _random_routes(batch, spec) -> None:
    """Each sample's engine routes: distinct top-k experts per position and MoE layer, at random;
    but the longest sample's (lost on the way): its micro-batch routes itself, recomputed or not."""
    g = torch.Generator().manual_seed(3)
    moe = spec.moe
    for sample in batch.samples:
        scores = torch.rand(sample.length - 1, len(moe.sparse_layers), moe.num_experts, generator=g)
        sample.routes = scores.topk(moe.top_k, dim=-1).indices.to(torch.uint8)
    max(batch.samples, key=lambda s: s.length).routes = None


def _watch(trainer, name: str) -> tuple[list[int], list[list[int]]]:
    """Forward calls of each layer's watched module (core attention under selective, else the MLP),
    and for each MoE router the routes it keeps for a rerun, after each of its runs."""
    layers = trainer.model[0].module.decoder.layers
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        watched = layer.self_attention.core_attention if name.endswith("selective") else layer.mlp
        watched.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    kept: list[list[int]] = []
    for router in trainer.routers.routers if trainer.routers else []:
        kept.append([])
        router.module.register_forward_hook(lambda *_, r=router, k=kept[-1]: k.append(len(r.rerun)))
    return calls, kept


def _step(spec, cfg, info, root: Path, name: str, batch):
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    trainer = PolicyTrainer(spec, cfg, info)
    if name == "none":
        save_model(trainer.model, root)
        assert trainer.model[0].config.recompute_granularity is None
    else:
        trainer.load_weights(root)
    calls, kept = _watch(trainer, name)
    metrics = trainer.train_step(batch).metrics
    layers = len(calls)
    forwards = 2 * len(trainer.microbatches(batch)[0])  # the prepass and the update
    recompute = name.removeprefix("replay-")
    again = {"none": 0, "selective": layers, "full": layers, "full-1": 1}[recompute]
    assert calls == [forwards + forwards // 2] * again + [forwards] * (layers - again), (name, calls)
    in_flight = min(info.pp_size - info.pp_rank, forwards // 2)  # 1F1B: micro-batches forward, not yet back
    rerun = {id(m) for layer in trainer.model[0].module.decoder.layers[:again] for m in layer.mlp.children()}
    for router, lengths in zip(trainer.routers.routers if trainer.routers else [], kept, strict=True):
        want = in_flight if id(router.module) in rerun and recompute != "selective" else 0
        assert max(lengths) == want and lengths[-1] == 0, (name, router.ordinal, lengths)
    state = trainer.model[0].module.state_dict()
    weights = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    return metrics, weights


def _same(results: dict, base: str, names, keys, arch: str) -> None:
    want_metrics, want_weights = results[base]
    for name in names:
        metrics, weights = results[name]
        for key in keys:
            assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-6, abs=1e-8), (arch, name, key)
        for key, tensor in weights.items():
            torch.testing.assert_close(tensor, want_weights[key], rtol=1e-6, atol=1e-7, msg=f"{arch} {name} {key}")


def _worker(rank: int, world: int, root: str) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel

    activate_cpu_shim()
    base = [*BASE, "parallel.pipeline=2"]
    info = None
    for arch in ("qwen2", "qwen3_moe"):
        spec, results = tiny_spec(arch), {}
        batch = make_batch(2, max_len=14)
        settings = dict(SETTINGS)
        if spec.moe is not None:
            _random_routes(batch, spec)
            settings.update(REPLAYED)
        for name, extra in settings.items():
            cfg = load_config(None, [*base, *extra])
            info = info or init_model_parallel(cfg.parallel, cfg.seed)
            results[name] = _step(spec, cfg, info, Path(root) / arch, name, batch)
        moe = ROUTER_FIGURES if spec.moe is not None else ()
        _same(results, "none", SETTINGS, COMPARED + moe, arch)
        if spec.moe is not None:
            _same(results, "replay-none", REPLAYED, COMPARED + moe, arch)
            for key in ("loss/pg", "train/grad_norm"):  # replay changes the step (random routes, not the router's)
                assert results["replay-none"][0][key] != pytest.approx(results["none"][0][key], rel=1e-4), key


def test_recompute_gives_the_same_step(tmp_path):
    run_workers(_worker, 2, str(tmp_path))


def _expert_parallel_worker(rank: int, world: int, root: str) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel

    activate_cpu_shim()
    spec, batch = tiny_spec("qwen3_moe"), make_batch(2, max_len=14)
    _random_routes(batch, spec)
    base = [*BASE, "parallel.expert=2", "algo.routing_replay=true"]
    results, info = {}, None
    for name in ("none", "full"):
        cfg = load_config(None, [*base, *SETTINGS[name]])
        info = info or init_model_parallel(cfg.parallel, cfg.seed)
        results[name] = _step(spec, cfg, info, Path(root) / "ep2", name, batch)
    _same(results, "none", ["full"], COMPARED + ROUTER_FIGURES, "qwen3_moe at EP=2")


def test_full_recompute_gives_the_same_step_at_expert_parallel_2(tmp_path):
    run_workers(_expert_parallel_worker, 2, str(tmp_path))
