"""Micro-batch planning by token budget, packing, and the rollout batch file format."""

import random

import pytest
import torch

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.trainer.microbatch import pack_microbatch, plan_microbatches, uniform_shape


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
    mbs = [pack_microbatch(samples, idx, [1.0, 1.0, 1.0], 4, shape=shape) for idx in plan]
    assert {mb.input_ids.shape for mb in mbs} == {(2, 8)}
    assert mbs[1].loss_mask[1].sum() == 0 and mbs[1].num_tokens == 1  # the padding row counts nothing
    with pytest.raises(ValueError, match="smaller than the micro-batch"):
        pack_microbatch(samples, [0, 1], [1.0] * 3, 4, shape=(1, 8))


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
    mb = pack_microbatch(samples, [0, 1], advantages=[0.5, -1.0], sequence_multiple=4)
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
