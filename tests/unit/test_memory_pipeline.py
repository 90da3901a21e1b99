"""The memory estimate under an interleaved (virtual) pipeline: the micro-batches a rank holds at its
peak are those of Megatron-Core 0.16.1's own warm-up count, which this test reads from upstream."""

from fractions import Fraction
from types import SimpleNamespace

import pytest

from bapo_megatron.config import load_config


def _megatron_in_flight(pp: int, vpp: int | None, rank: int) -> Fraction:
    """Chunk forwards before rank's first backward, and the one beside it, in whole micro-batches
    (a chunk holds 1 / VPP of the rank's layers): from schedules.get_pp_rank_microbatches."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    group = SimpleNamespace(size=lambda: pp, rank=lambda: rank)
    communicator = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp)
    chunks = vpp or 1
    _, _, warmup, _ = get_pp_rank_microbatches(64, chunks, pp, p2p_communicator=communicator)  # group: PP
    return Fraction(warmup + 1, chunks)


@pytest.mark.parametrize(("pp", "vpp"), [(2, None), (4, None), (2, 2), (4, 2), (4, 4), (8, 3)])
def test_micro_batches_in_flight_are_megatrons(pp, vpp):
    from bapo_megatron.trainer.memory.estimate import micro_batches_in_flight

    more = [f"parallel.virtual_pipeline={vpp}"] if vpp else []
    parallel = load_config(None, [f"parallel.pipeline={pp}", *more]).parallel
    for stage in range(pp):
        assert micro_batches_in_flight(parallel, stage) == _megatron_in_flight(pp, vpp, stage)
    if vpp:  # the first stage: PP + (PP - 1) / VPP
        assert micro_batches_in_flight(parallel, 0) == pp + Fraction(pp - 1, vpp)


def test_the_dry_run_counts_the_virtual_pipeline():
    """The 32B preset's layout (PP 2, no recompute) with VPP 2: its first stage holds 2.5 micro-batches'
    activations instead of 2."""
    from bapo_megatron.preflight import model_spec
    from bapo_megatron.trainer.memory.estimate import activation_bytes

    shape = ["model.hf_path=examples/qwen2.5-32b/shape", "model.transformer_impl=transformer_engine"]
    plain = load_config(None, [*shape, "model.precision=bf16", "parallel.tensor=8", "parallel.pipeline=2"])
    virtual = load_config(None, [*shape, "model.precision=bf16", "parallel.tensor=8", "parallel.pipeline=2",
                                 "parallel.virtual_pipeline=2"])  # fmt: skip
    spec = model_spec(plain)
    before = activation_bytes(spec, plain.model, plain.parallel, 8192, 0)
    after = activation_bytes(spec, virtual.model, virtual.parallel, 8192, 0)
    assert after == before * 5 // 4
