"""Packed micro-batches (parallel.packing=packed: samples end to end in rows, a block-diagonal causal
mask on CPU) give the padded path's step: every response token's log-prob and entropy, and after one
BAPO optimizer step the loss, gradient norm, clip bounds and gradients, for the tiny dense model and
the tiny Qwen3-MoE with the engine's routes replayed (random routes, so that a route landing on
the wrong position shows). With a virtual pipeline (PP=2 x 2 chunks), where the padded path pads
every micro-batch to the step's largest, packed rows give the same step on far fewer computed
tokens (perf/packing_efficiency).

The same comparison catches a layer that mixes a packed row's samples: a toy Qwen2 family whose
attention ignores the packing mask (as a sliding window's own mask or a recurrent state would)
gives another step packed, unless its family says so (Family.packing_leak) and the planner
trains it one sample a row."""

from pathlib import Path

import pytest
import torch

from bapo_megatron.models.qwen2 import Qwen2
from bapo_megatron.models.spec import ModelSpec
from tests.dist.launch import run_workers
from tests.helpers import make_batch

BASE = ["optimizer.lr=1e-3", "optimizer.adam_eps=1e-6", "parallel.max_tokens_per_microbatch=48"]


def token_logprobs(trainer, batch) -> dict[int, torch.Tensor]:
    """Each sample's response tokens' (log-prob, entropy) from a forward-only pass, by sample index
    (on the last pipeline stage; empty elsewhere)."""
    mbs, _ = trainer.microbatches(batch)
    found: dict[int, torch.Tensor] = {}

    def collect(mb, logits):
        logp, entropy = trainer._logprobs(mb, logits, batch.temperature)
        for k, i in enumerate(mb.sample_index):
            row, span = (k, slice(None)) if mb.cu_seqlens is None else (0, slice(*mb.cu_seqlens[k : k + 2].tolist()))
            counted = mb.loss_mask[row, span] > 0
            found[i] = torch.stack([logp[row, span][counted], entropy[row, span][counted]])
        return logits.new_zeros(()), torch.tensor(mb.num_tokens, dtype=torch.int), {}

    with torch.no_grad():
        trainer._run(mbs, collect, forward_only=True)
    return found


def _random_routes(batch, spec) -> None:
    g = torch.Generator().manual_seed(1)
    moe = spec.moe
    for sample in batch.samples:
        scores = torch.rand(sample.length - 1, len(moe.sparse_layers), moe.num_experts, generator=g)
        sample.routes = scores.topk(moe.top_k, dim=-1).indices.to(torch.uint8)


def _gradients(trainer) -> dict[str, torch.Tensor]:
    """Each parameter's gradient of the step that just ran (DDP's main_grad: the next step zeroes it)."""
    out = {}
    for c, chunk in enumerate(trainer.model):
        for k, p in chunk.module.named_parameters():
            out[f"{c}.{k}"] = p.main_grad.clone()
    return out


def _compare(root: Path, arch: str, layouts: dict[str, list[str]], extra: list[str]) -> dict[str, dict]:
    """Each named layout's (log-probs, step metrics, gradients) from the same starting weights."""
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.dist_ckpt import save_model
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec = tiny_spec(arch)
    batch = make_batch(3, max_len=14, temperature=0.9)
    if spec.moe is not None:
        _random_routes(batch, spec)
    results = {}
    for name, setting in layouts.items():
        cfg = load_config(None, [*BASE, *extra, *setting])
        trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        if not (root / arch).exists():
            save_model(trainer.model, root / arch)
        trainer.load_weights(root / arch)
        logprobs = token_logprobs(trainer, batch)
        metrics = trainer.train_step(batch).metrics
        results[name] = (logprobs, metrics, _gradients(trainer))
    return results


def _assert_same(results: dict, reference: str, label: str) -> None:
    want_logprobs, want_metrics, want_grads = results[reference]
    for name, (logprobs, metrics, grads) in results.items():
        assert logprobs.keys() == want_logprobs.keys()
        for i, got in logprobs.items():
            torch.testing.assert_close(got, want_logprobs[i], rtol=0, atol=2e-5, msg=f"{label} {name} sample {i}")
        for key in ("loss/pg", "train/grad_norm", "policy/entropy", "bapo/clip_low", "bapo/clip_high"):
            if key in want_metrics:
                assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), (label, name, key)
        # gradients, each to 1e-5 of its tensor's largest (measured: 1e-6 at most); not the weights after
        # Adam, whose g / (|g| + eps) turns the last bits that rows of another shape sum differently, in a
        # gradient near eps, into a 1e-6 weight difference (1.2e-6 in qwen3_moe's embedding, where its |g|
        # is 1.3e-6), and leaves a gradient far above eps unchecked (its update is lr whatever its size)
        for key, grad in grads.items():
            scale = want_grads[key].abs().max().item()
            torch.testing.assert_close(grad, want_grads[key], rtol=0, atol=1e-5 * scale, msg=f"{label} {name} {key}")


def _one_process(rank: int, world: int, root: str) -> None:
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()
    layouts = {"padded": ["parallel.packing=padded"], "packed": ["parallel.packing=packed"]}
    dense = _compare(Path(root), "qwen2", layouts, [])
    _assert_same(dense, "padded", "qwen2")
    for name in layouts:
        assert 0.5 < dense[name][1]["perf/packing_efficiency"] <= 1, (name, dense[name][1])
    moe = _compare(Path(root), "qwen3_moe", layouts, ["algo.routing_replay=true"])
    _assert_same(moe, "padded", "qwen3_moe")
    assert moe["packed"][1]["moe/router_disagreement"] == pytest.approx(moe["padded"][1]["moe/router_disagreement"])


class LeakyQwen2(Qwen2):
    """Qwen2 with a core attention that drops the mask it is given (the causal mask over the whole
    row instead), saying so or not."""

    name = "leaky_qwen2"
    architectures = ("LeakyQwen2ForCausalLM",)
    leak: str | None = "toy attention that drops the packing mask"

    def tiny(self) -> ModelSpec:
        return ModelSpec(**{**super().tiny().as_dict(), "architecture": self.name})

    def layer_spec(self, spec, te, config=None, vp_stage=None):
        layer = super().layer_spec(spec, te, config, vp_stage)
        layer.submodules.self_attention.submodules.core_attention = _mask_dropping_attention()
        return layer

    def packing_leak(self, spec, te):
        return self.leak


def _mask_dropping_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MaskDropping(DotProductAttention):
        def forward(self, query, key, value, attention_mask, *args, **kwargs):
            return super().forward(query, key, value, None, *args, **kwargs)

    return MaskDropping


def _virtual_pipeline(rank: int, world: int, root: str) -> None:
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

    activate_cpu_shim()
    vpp = ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]
    layouts = {"padded": ["parallel.packing=padded"], "auto": []}  # auto packs under a virtual pipeline
    results = _compare(Path(root), "qwen2", layouts, vpp)
    if rank == world - 1:  # the last stage computes the log-probs
        _assert_same(results, "padded", "vpp")
    padded, packed = (results[name][1]["perf/packing_efficiency"] for name in ("padded", "auto"))
    assert packed > 1.5 * padded, (padded, packed)
    _leak_caught(Path(root), vpp, last_stage=rank == world - 1)


def _leak_caught(root: Path, vpp: list[str], last_stage: bool) -> None:
    """The leaky family packed (auto, its leak unsaid) gives another step than padded; said, auto
    trains it one sample a row and gives the padded step."""
    from bapo_megatron.models import FAMILIES

    family = FAMILIES[LeakyQwen2.name] = LeakyQwen2()
    said = _compare(root, LeakyQwen2.name, {"padded": ["parallel.packing=padded"], "auto": []}, vpp)
    family.leak = None
    results = {**said, "unsaid": _compare(root, LeakyQwen2.name, {"unsaid": []}, vpp)["unsaid"]}
    assert said["auto"][1]["perf/packing_efficiency"] == said["padded"][1]["perf/packing_efficiency"]
    if last_stage:
        _assert_same({k: results[k] for k in ("padded", "auto")}, "padded", "leak said")
        mixed = [i for i, lp in results["unsaid"][0].items() if not torch.allclose(lp, said["padded"][0][i])]
        assert mixed, "a packed row's samples mixed, and the comparison did not show it"


@pytest.mark.dist
def test_packed_rows_give_the_padded_step(tmp_path):
    run_workers(_one_process, 1, str(tmp_path))


@pytest.mark.dist
def test_packed_rows_under_a_virtual_pipeline(tmp_path):
    run_workers(_virtual_pipeline, 2, str(tmp_path))
