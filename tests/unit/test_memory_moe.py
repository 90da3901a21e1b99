"""The memory estimate of a mixture-of-experts model, against a count by hand: Qwen3-30B-A3B at its
preset's layout (TP 4 x EP 8 x DP 8 on 32 GPUs, sequence parallel), the experts' optimizer state
sharded over expert data parallel, a frozen router, and the routing-replay storage a step needs."""

import dataclasses
from pathlib import Path

import pytest

from bapo_megatron.config import ModelConfig, MoEConfig, ParallelConfig, load_config
from bapo_megatron.models.spec import ModelSpec, padded_vocab_size, tiny_spec
from bapo_megatron.trainer.memory.estimate import rank_params, routing_replay_bytes, trainer_memory

ROOT = Path(__file__).resolve().parents[2]
PRESET = ROOT / "examples" / "qwen3-30b-a3b"
GIB = 2**30

# Qwen3-30B-A3B (config.json): 48 layers, hidden 2048, 32 heads and 4 kv heads of 128, q/k norms,
# 128 experts of width 768, top-8, vocab 151936 untied. The layout: TP 4, EP 8, PP 1, 32 GPUs: DP 8,
# expert data parallel 4 x 8 / 8 = 4.
ATTENTION = 2048 * 32 * 128 + 2 * 2048 * 4 * 128 + 32 * 128 * 2048  # q, k and v, o: 18,874,368
NORMS = 2 * 2048 + 2 * 128  # the two RMSNorms, the q and k norms (replicated over TP)
ROUTER = 128 * 2048  # replicated over TP
EXPERTS = 128 * 3 * 2048 * 768  # gate, up, down of each expert: 603,979,776 a layer, split over EP
VOCAB = 149 * 1024  # 151,936 padded to a multiple of 128 x lcm(TP 4, vocab_pad_tp 8) = 1,024
DENSE = 48 * (ATTENTION // 4 + NORMS + ROUTER) + 2 * VOCAB * 2048 // 4 + 2048  # + embedding, output, final norm
EXPERT = 48 * EXPERTS // 8  # 16 whole experts a layer on each EP rank


def _preset() -> tuple[ModelSpec, ModelConfig, ParallelConfig]:
    cfg = load_config(PRESET / "config.yaml")
    return ModelSpec.from_hf_dir(PRESET / "shape"), cfg.model, cfg.parallel


def test_the_shape_is_qwen3_30b_a3b():
    spec, _, parallel = _preset()
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        48,
        2048,
        32,
        4,
        128,
    )
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.ffn_hidden_size) == (128, 8, 768)
    assert spec.moe.sparse_layers == tuple(range(48)) and spec.moe.norm_topk_prob and spec.qk_norm
    assert (spec.vocab_size, spec.tie_embeddings) == (151936, False)
    assert (parallel.tensor, parallel.expert, parallel.pipeline, parallel.sequence_parallel) == (4, 8, 1, True)
    total = 48 * (ATTENTION + NORMS + ROUTER + EXPERTS) + 2 * 151936 * 2048 + 2048
    assert total == 30_532_122_624  # the model card's 30.5 B


def test_parameters_gradients_and_optimizer_by_hand():
    spec, model, parallel = _preset()
    assert (DENSE, EXPERT) == (395_524_096, 3_623_878_656)
    assert rank_params(spec, VOCAB, 4, 1, 0, expert=8).dense == DENSE
    got = trainer_memory(spec, model, parallel, data_parallel=8)
    assert got.params == (DENSE + EXPERT) * 2  # bf16
    assert got.grads == (DENSE + EXPERT) * 4  # the fp32 gradient buffer
    # fp32 main weights + Adam's two moments: the dense state over DP 8, the experts' over EDP 4
    assert got.optimizer == DENSE * 12 // 8 + EXPERT * 12 // 4
    assert got.experts == EXPERT * (2 + 4) + EXPERT * 12 // 4
    replicated = trainer_memory(spec, model, parallel, data_parallel=8, distributed_optimizer=False)
    assert replicated.optimizer == (DENSE + EXPERT) * 12


def test_activations_by_hand():
    """Per token and layer, bf16, everything split over TP 4 (sequence parallel): q, k, v; the core
    attention's output and the o projection's input; the normalised q and k; two norm inputs and two
    residuals; the experts' share: 8 routed copies of (the permuted token, gate and up, SwiGLU
    output), the router's fp32 logits and scores and the 8 fp32 probabilities; then the logits of
    the micro-batch and their fp32 gradient, and the log-prob memory."""
    spec, model, parallel = _preset()
    attention = (32 + 2 * 4) * 128 + 2 * 32 * 128 + (32 + 4) * 128
    norms = 4 * 2048
    experts = 8 * (2048 + 3 * 768) * 2 + 4 * (2 * 128 + 8)
    per_token = 48 * ((attention + norms) // 4 * 2 + experts // 4)
    assert per_token == 48 * 30_728
    tokens = parallel.max_tokens_per_microbatch
    logits = tokens * VOCAB // 4 * (2 + 4)
    got = trainer_memory(spec, model, parallel, data_parallel=8)
    assert got.activations == per_token * tokens + logits + (1024 << 20)
    assert got.peak / GIB == pytest.approx(63.39, abs=0.01) and got.peak < 80 * GIB


def test_routing_replay_storage():
    spec, _, _ = _preset()
    cfg = load_config(PRESET / "config.yaml")
    r = cfg.rollout
    tokens = r.prompts_per_step * r.samples_per_prompt * (cfg.data.max_prompt_tokens + r.sampling.max_new_tokens)
    assert tokens == 64 * 16 * (2048 + 16384)
    assert routing_replay_bytes(spec, tokens) == 48 * 8 * 1 * tokens  # an expert index fits a byte
    many = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, num_experts=512))
    assert routing_replay_bytes(many, 10) == 48 * 8 * 2 * 10
    assert routing_replay_bytes(tiny_spec("qwen3"), 10) == 0


def test_dry_run_prints_the_experts_and_the_routes():
    from bapo_megatron import cli

    out = cli.dry_run(load_config(PRESET / "config.yaml"), 32, 80 * GIB)
    assert "EP 8: 16 whole experts on each rank (expert TP 1)" in out
    assert "sharded over expert data parallel 4 (the rest over DP 8)" in out
    assert "routing replay (R3): 48 MoE layers x top-8 x 1 byte = 384 B a token" in out
    assert "= 18,874,368 tokens: 6.75 GiB" in out
    assert "routing replay" not in cli.dry_run(load_config(ROOT / "examples/qwen3-8b/config.yaml"), 8, 80 * GIB)


def test_a_frozen_router_has_no_gradient_or_optimizer_state():
    spec = tiny_spec("qwen3_moe")  # 4 experts of width 32 in layers 1-3, hidden 64
    parallel = ParallelConfig(tensor=2, expert=2, sequence_parallel=True)
    trained = trainer_memory(spec, ModelConfig(precision="bf16"), parallel, data_parallel=2)
    frozen = trainer_memory(spec, ModelConfig(precision="bf16", moe=MoEConfig(freeze_router=True)), parallel, 2)
    routers = 3 * 4 * 64
    assert trained.params == frozen.params
    assert trained.grads - frozen.grads == routers * 4
    assert trained.optimizer - frozen.optimizer == routers * 12 // 2


def test_expert_state_shards_over_expert_data_parallel():
    """At EP 1 the experts' state shards over as many ranks as the rest (TP x DP / EP = DP when
    TP is 1); at EP = DP each expert lives on one rank and its state is not sharded at all."""
    spec, model = tiny_spec("qwen3_moe"), ModelConfig(precision="bf16")
    n = rank_params(spec, padded_vocab_size(spec.vocab_size, 128, 1, 8), 1, 1, 0)
    ep1 = trainer_memory(spec, model, ParallelConfig(), data_parallel=4)
    assert ep1.optimizer == n.dense * 12 // 4 + n.experts * 12 // 4
    ep4 = trainer_memory(spec, model, ParallelConfig(expert=4), data_parallel=4)
    assert ep4.optimizer == n.dense * 12 // 4 + n.experts // 4 * 12
    assert ep4.params == (n.dense + n.experts // 4) * 2
