"""The trainer memory estimate counts exactly the parameters Megatron builds on each rank
(TP=2 x PP=2: an untied, a tied-embedding and a q/k-norm model; the tiny Qwen3-MoE at EP=2 too, its
experts split over the two tensor-parallel ranks), and its byte figures follow from them."""

import dataclasses

import pytest

from tests.dist.launch import run_workers
from tests.unit.test_cli import QWEN7B


def _count(rank: int, world: int) -> None:
    from megatron.core import parallel_state as ps

    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer import megatron_config as mc
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.memory.estimate import stage_params
    from bapo_megatron.trainer.parallel import init_model_parallel

    activate_cpu_shim()
    dense = ParallelConfig(tensor=2, pipeline=2)
    moe = ParallelConfig(tensor=2, pipeline=2, expert=2, sequence_parallel=True)
    init_model_parallel(moe, 0)  # the expert groups exist; a dense model's config leaves them unused
    stage = ps.get_pipeline_model_parallel_rank()
    specs = (tiny_spec("qwen2"), dataclasses.replace(tiny_spec("llama"), tie_embeddings=True), tiny_spec("qwen3"))
    for spec, parallel in [*((s, dense) for s in specs), (tiny_spec("qwen3_moe"), moe)]:
        model = mc.build_gpt_model(spec, ModelConfig(), parallel, pre_process=stage == 0, post_process=stage == 1)
        built = sum(p.numel() for p in model.parameters())
        vocab = mc.padded_vocab(spec, ModelConfig(), parallel)
        assert built == stage_params(spec, vocab, 2, 2, stage, expert=parallel.expert), (
            spec.architecture,
            stage,
            built,
        )


@pytest.mark.dist
def test_parameter_counts_match_megatrons_model():
    run_workers(_count, 4)


def test_byte_figures_and_the_colocated_fraction():
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.trainer.memory.estimate import colocated_mem_fraction, trainer_memory

    qwen7b = ModelSpec.from_hf_config(QWEN7B)
    bf16 = ModelConfig(precision="bf16", transformer_impl="transformer_engine")
    one = trainer_memory(qwen7b, bf16, ParallelConfig(), data_parallel=1)
    n = one.params // 2
    assert 7.6e9 < n < 7.7e9  # Qwen2.5-7B: 7.62 B parameters (the vocabulary padded to 152,064)
    assert one.grads == 4 * n and one.optimizer == 12 * n  # fp32 grads; Adam moments and fp32 main weights
    sharded = trainer_memory(qwen7b, bf16, ParallelConfig(), data_parallel=8)
    assert sharded.optimizer == 12 * n // 8 and sharded.params == one.params
    tp4 = trainer_memory(qwen7b, bf16, ParallelConfig(tensor=4, sequence_parallel=True), data_parallel=2)
    assert tp4.params < one.params / 3.5 and tp4.activations < one.activations
    fraction = colocated_mem_fraction(80 << 30, tp4)
    assert 0.1 <= fraction < 0.9 - tp4.resident / (80 << 30) + 1e-3
    with pytest.raises(ValueError, match=r"the trainer keeps 127.7 GiB per GPU .* of 80.0 GiB"):
        colocated_mem_fraction(80 << 30, one)  # 7.6 B x 18 bytes (bf16, fp32 grads and Adam): nothing left
