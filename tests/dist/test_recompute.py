"""Activation recompute (parallel.recompute) changes memory, not the step: one optimizer step with
selective and with full recompute gives the loss, gradient norm and updated weights of the step
without, for the tiny dense model and the tiny Qwen3-MoE (one process, the CPU shim). That the
recompute happens is counted: the recomputed modules run forward again in the backward pass
(core attention under selective; a recomputed layer's MLP under full, the first 2 layers only
with recompute_layers=2)."""

from pathlib import Path

import pytest
import torch

from tests.dist.launch import run_workers
from tests.helpers import make_batch

SETTINGS = {"none": [], "selective": ["parallel.recompute=selective"], "full": ["parallel.recompute=full"]}
SETTINGS["full-2"] = ["parallel.recompute=full", "parallel.recompute_layers=2"]


def _worker(rank: int, world: int, root: str) -> None:
    from bapo_megatron.common.model_spec import tiny_spec
    from bapo_megatron.config import load_config
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    activate_cpu_shim()
    batch = make_batch(2, max_len=14)
    base = ["optimizer.lr=1e-3", "optimizer.adam_eps=1e-6", "parallel.max_tokens_per_microbatch=48"]
    info = None
    for arch in ("qwen2", "qwen3_moe"):
        spec, results = tiny_spec(arch), {}
        for name, extra in SETTINGS.items():
            cfg = load_config(None, [*base, *extra])
            info = info or init_model_parallel(cfg.parallel, cfg.seed)
            trainer = PolicyTrainer(spec, cfg, info)
            if name == "none":
                save_model(trainer.model, Path(root) / arch)
                assert trainer.model[0].config.recompute_granularity is None
            else:
                trainer.load_weights(Path(root) / arch)
                assert trainer.model[0].config.recompute_granularity == name.split("-")[0]
            calls = [0] * spec.num_layers
            for i, layer in enumerate(trainer.model[0].module.decoder.layers):
                watched = layer.self_attention.core_attention if name == "selective" else layer.mlp
                watched.register_forward_hook(lambda *_, i=i, c=calls: c.__setitem__(i, c[i] + 1))
            metrics = trainer.train_step(batch).metrics
            forwards = 2 * len(trainer.microbatches(batch)[0])  # the prepass and the update
            again = {"none": 0, "selective": spec.num_layers, "full": spec.num_layers, "full-2": 2}[name]
            assert calls == [forwards + forwards // 2] * again + [forwards] * (spec.num_layers - again), (name, calls)
            state = trainer.model[0].module.state_dict()
            weights = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
            results[name] = (metrics, weights)
        want_metrics, want_weights = results["none"]
        for name, (metrics, weights) in results.items():
            for key in ("loss/pg", "train/grad_norm", "policy/entropy"):
                assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-6, abs=1e-8), (arch, name, key)
            for key, tensor in weights.items():
                torch.testing.assert_close(tensor, want_weights[key], rtol=1e-6, atol=1e-7, msg=f"{arch} {name} {key}")


def test_recompute_gives_the_same_step(tmp_path):
    run_workers(_worker, 1, str(tmp_path))
