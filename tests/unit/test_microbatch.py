"""Micro-batch planning by token budget, packing, and the rollout batch file format."""

import random

import pytest
import torch

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.trainer.microbatch import pad_microbatch, plan_microbatches, uniform_shape


@pytest.mark.parametrize("seed", range(30))
def test_plan_covers_every_sample_once_within_budget(seed):
    rng = random.Random(seed)
    dp = rng.choice([1, 2, 4])
    n = dp * rng.randint(1, 12)
    lengths = [rng.randint(1, 100) for _ in range(n)]
    budget = rng.randint(100, 400)
    multiple = rng.choice([1, 2, 4]) if n // dp >= 4 else 1  # a virtual pipeline's group of micro-batches
    plan = plan_microbatches(lengths, dp, budget, multiple_of=multiple)
    assert len(plan) == dp
    assert len({len(rank) for rank in plan}) == 1  # same micro-batch count on every rank
    assert len(plan[0]) % multiple == 0
    flat = sorted(i for rank in plan for mb in rank for i in mb)
    assert flat == list(range(n))
    assert {len([i for mb in rank for i in mb]) for rank in plan} == {n // dp}
    for rank in plan:
        for mb in rank:
            assert mb and len(mb) * max(lengths[i] for i in mb) <= budget


def test_plan_errors():
    with pytest.raises(ValueError, match="5 samples cannot be split evenly over 2"):
        plan_microbatches([1] * 5, 2, 10)
    with pytest.raises(ValueError, match="sample 1 has 30 tokens, more than parallel.max_tokens_per_microbatch=20"):
        plan_microbatches([5, 30], 1, 20)
    with pytest.raises(ValueError, match="3 samples per data-parallel rank cannot make 4 micro-batches"):
        plan_microbatches([1] * 6, 2, 100, multiple_of=4)


def test_uniform_shape_pads_every_micro_batch_to_one_shape():
    samples = [_sample([5, 6], [7, 8, 9]), _sample([1], [2]), _sample([1, 2, 3], [4])]
    plan = [[0, 1], [2]]
    shape = uniform_shape(samples, plan, sequence_multiple=4)
    assert shape == (2, 8)
    mbs = [pad_microbatch(samples, idx, [1.0, 1.0, 1.0], 4, shape=shape) for idx in plan]
    assert {mb.input_ids.shape for mb in mbs} == {(2, 8)}
    assert mbs[1].loss_mask[1].sum() == 0 and mbs[1].num_tokens == 1  # the padding row counts nothing
    with pytest.raises(ValueError, match="smaller than the micro-batch"):
        pad_microbatch(samples, [0, 1], [1.0] * 3, 4, shape=(1, 8))


def _sample(prompt, response, group=0, mask=None):
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        behaviour_logprobs=[-0.1 * (k + 1) for k in range(len(response))],
        versions=[3] * len(response),
        reward=1.0,
        group=group,
        loss_mask=mask,
    )


def test_pack_aligns_targets_logprobs_and_mask():
    samples = [_sample([5, 6], [7, 8, 9]), _sample([1], [2], mask=[0])]
    mb = pad_microbatch(samples, [0, 1], advantages=[0.5, -1.0], sequence_multiple=4)
    assert mb.input_ids.shape == (2, 8)
    assert mb.input_ids[0, :5].tolist() == [5, 6, 7, 8, 9]
    assert mb.targets[0, :4].tolist() == [6, 7, 8, 9]
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]  # positions 1..3 predict 7, 8, 9
    torch.testing.assert_close(mb.old_logprobs[0, 1:4], torch.tensor([-0.1, -0.2, -0.3]))
    assert mb.advantages[0].tolist()[1:4] == [0.5] * 3
    assert mb.loss_mask[1].sum() == 0 and mb.advantages[1].abs().sum() == 0  # masked-out response
    assert mb.versions[0].tolist()[:5] == [-1, 3, 3, 3, -1]
    assert mb.num_tokens == 3


def test_rollout_batch_round_trip_and_corrupt_files(tmp_path):
    batch = RolloutBatch(
        samples=[_sample([1, 2], [3, 4], group=0), _sample([1, 2], [5], group=0, mask=[0])],
        temperature=0.7,
        metadata={"step": "4"},
    )
    path = tmp_path / "step.safetensors"
    batch.save(path)
    loaded = RolloutBatch.load(path)
    assert loaded.temperature == 0.7 and loaded.metadata == {"step": "4"}
    assert [s.response_ids for s in loaded.samples] == [[3, 4], [5]]
    assert loaded.samples[1].loss_mask == [0]
    torch.testing.assert_close(torch.tensor(loaded.samples[0].behaviour_logprobs), torch.tensor([-0.1, -0.2]))
    (tmp_path / "bad.safetensors").write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match="bad.safetensors: not a readable safetensors file"):
        RolloutBatch.load(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="no such file"):
        RolloutBatch.load(tmp_path / "missing")
    with pytest.raises(ValueError, match="versions has 1 entries for 2 response tokens"):
        Sample(prompt_ids=[1], response_ids=[2, 3], behaviour_logprobs=[0, 0], versions=[1], reward=0, group=0)


@pytest.mark.parametrize("seed", range(30))
def test_packed_plan_covers_every_sample_once_in_rows_of_the_capacity(seed):
    from bapo_megatron.trainer.packing import plan_packed

    rng = random.Random(seed)
    dp = rng.choice([1, 2, 4])
    n = dp * rng.randint(1, 12)
    lengths = [rng.randint(1, 100) for _ in range(n)]
    capacity = rng.randint(100, 400)
    multiple = rng.choice([1, 2, 4]) if n // dp >= 4 else 1
    plan = plan_packed(lengths, dp, capacity, multiple_of=multiple)
    assert len(plan) == dp and len({len(rank) for rank in plan}) == 1 and len(plan[0]) % multiple == 0
    assert sorted(i for rank in plan for mb in rank for i in mb) == list(range(n))
    assert all(mb and sum(lengths[i] for i in mb) <= capacity for rank in plan for mb in rank)


def test_packed_plan_fills_rows():
    from bapo_megatron.trainer.packing import plan_packed

    # best fit, longest first: 70+30, 60+40, 50+50 make three full rows of 100
    plan = plan_packed([50, 30, 70, 60, 40, 50], 1, 100)
    assert sorted(sorted([50, 30, 70, 60, 40, 50][i] for i in mb) for mb in plan[0]) == [[30, 70], [40, 60], [50, 50]]
    # two ranks, an interleaved schedule's groups of 2: four rows are needed, the fullest is split
    plan = plan_packed([50, 30, 70, 60, 40, 50], 2, 100, multiple_of=2)
    assert [len(rank) for rank in plan] == [2, 2]
    with pytest.raises(ValueError, match="3 samples per data-parallel rank cannot make 4 micro-batches"):
        plan_packed([10] * 6, 2, 100, multiple_of=4)
    with pytest.raises(ValueError, match="sample 1 has 30 tokens, more than parallel.max_tokens_per_microbatch=20"):
        plan_packed([5, 30], 1, 20)


def test_packed_row_keeps_each_sample_and_its_attention_apart():
    from bapo_megatron.trainer.packing import block_causal_mask, pack_row

    samples = [_sample([5, 6], [7, 8, 9]), _sample([1], [2], mask=[0]), _sample([3, 4], [5])]
    samples[0].routes = torch.tensor([[[1, 2]]] * 4, dtype=torch.uint8)
    samples[2].routes = torch.tensor([[[3, 0]]] * 2, dtype=torch.uint8)
    samples[1].routes = torch.tensor([[[2, 3]]] * 1, dtype=torch.uint8)
    mb = pack_row(samples, [0, 1, 2], advantages=[0.5, -1.0, 2.0], length=12)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 10, 12] and mb.max_seqlen == 5
    assert mb.targets[0, :4].tolist() == [6, 7, 8, 9] and mb.targets[0, 7:9].tolist() == [4, 5]
    assert mb.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0]  # a sample's last token predicts nothing
    assert mb.advantages[0, 8] == 2.0 and mb.versions[0, 8] == 3 and mb.num_tokens == 4
    assert mb.token_mask[0].tolist() == [True] * 10 + [False] * 2
    assert mb.route_mask[0].tolist() == [True] * 4 + [False] + [True] + [False] + [True] * 2 + [False] * 3
    assert mb.routes[0, 7, 0].tolist() == [3, 0] and mb.routes[0, 3, 0].tolist() == [1, 2]
    mask = block_causal_mask(mb.cu_seqlens, 12)[0, 0]
    allowed = [(~mask[q]).nonzero().view(-1).tolist() for q in (0, 4, 5, 6, 9, 11)]
    assert allowed == [[0], [0, 1, 2, 3, 4], [5], [5, 6], [7, 8, 9], [10, 11]]
    with pytest.raises(ValueError, match="12 tokens of samples do not fit a packed row of 10"):
        pack_row([*samples, _sample([1], [1])], [0, 1, 2, 3], [0.0] * 4, length=10)


def test_packing_efficiency_and_the_layout_each_setting_takes():
    from bapo_megatron.config import ModelConfig, ParallelConfig
    from bapo_megatron.trainer.packing import (
        MaskedRowAttention,
        PackedLayout,
        PaddedLayout,
        ThdAttention,
        microbatch_layout,
    )

    spec = tiny_spec()
    local, te = ModelConfig(), ModelConfig(transformer_impl="transformer_engine")
    vpp = ParallelConfig(pipeline=2, virtual_pipeline=2)
    assert isinstance(microbatch_layout(spec, local, ParallelConfig(), 1), PaddedLayout)
    assert microbatch_layout(spec, te, ParallelConfig(), 1).attention == ThdAttention()
    assert microbatch_layout(spec, local, vpp, 1).attention == MaskedRowAttention()
    assert isinstance(microbatch_layout(spec, te, ParallelConfig(packing="padded"), 1), PaddedLayout)
    assert microbatch_layout(spec, local, ParallelConfig(packing="packed"), 1).attention == MaskedRowAttention()
    lengths = [90, 10, 10, 10, 50, 50]
    padded = PaddedLayout(budget=100, sequence_multiple=1, uniform=False)
    plan = padded.plan(lengths, 1, 1)
    assert plan == [[[0], [4, 5], [1, 2, 3]]]
    assert padded.computed_tokens(lengths, plan) == 90 + 2 * 50 + 3 * 10
    uniform = PaddedLayout(budget=100, sequence_multiple=1, uniform=True)
    assert uniform.computed_tokens(lengths, plan) == 3 * 3 * 90  # every micro-batch [3, 90]
    packed = PackedLayout(budget=100, sequence_multiple=8, uniform=False, attention=MaskedRowAttention())
    plan = packed.plan(lengths, 1, 1)  # three rows are needed (260 tokens), the shortest such: at most 90
    assert sorted(sorted(lengths[i] for i in row) for row in plan[0]) == [[10, 10, 10, 50], [50], [90]]
    assert packed.computed_tokens(lengths, plan) == 96 + 80 + 56  # rounded up to multiples of 8
    packed = PackedLayout(budget=100, sequence_multiple=8, uniform=True, attention=MaskedRowAttention())
    assert packed.computed_tokens(lengths, plan) == 3 * 96
