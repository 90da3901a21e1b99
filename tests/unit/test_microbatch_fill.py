"""fill_samples writes all of a micro-batch's samples in one indexed write per tensor: bit for bit what
writing each sample's slices one by one gives, in padded rows and packed ones."""

import random

import pytest
import torch

from bapo_megatron.common.batch import Sample
from bapo_megatron.trainer.microbatch import new_rows, pad_microbatch
from bapo_megatron.trainer.packing import pack_row


def _samples(seed: int, n: int = 12) -> tuple[list[Sample], list[float]]:
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        r = rng.randint(1, 7)
        samples.append(
            Sample(
                prompt_ids=[rng.randrange(1, 50) for _ in range(rng.randint(1, 5))],
                response_ids=[rng.randrange(1, 50) for _ in range(r)],
                behaviour_logprobs=[-rng.expovariate(0.5) for _ in range(r)],
                versions=[rng.randrange(4) for _ in range(r)],
                reward=0.0,
                group=0,
                loss_mask=None if rng.random() < 0.5 else [rng.choice([0, 1]) for _ in range(r)],
            )
        )
    return samples, [rng.gauss(0, 1) for _ in range(n)]  # negative advantages: -0.0 where masked


def _one_by_one(rows: dict, row: int, start: int, s: Sample, advantage: float) -> None:
    """Each tensor's slices of one sample, as the trainer wrote them before fill_samples."""
    tokens = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
    p, r, n = len(s.prompt_ids), len(s.response_ids), len(tokens)
    rows["input_ids"][row, start : start + n] = tokens
    rows["token_mask"][row, start : start + n] = True
    rows["targets"][row, start : start + n - 1] = tokens[1:]
    span = slice(start + p - 1, start + p - 1 + r)
    mask = torch.tensor(s.loss_mask if s.loss_mask is not None else [1] * r, dtype=torch.float32)
    rows["loss_mask"][row, span] = mask
    rows["old_logprobs"][row, span] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32) * (mask != 0)
    rows["advantages"][row, span] = advantage * (mask != 0)
    rows["versions"][row, span] = torch.tensor(s.versions, dtype=torch.long)


def _assert_bitwise(mb, want: dict) -> None:
    for name, tensor in want.items():
        got = getattr(mb, name)
        same = (
            got.view(torch.int32).equal(tensor.view(torch.int32)) if tensor.is_floating_point() else got.equal(tensor)
        )
        assert same, name  # floats compared as bits: a -0.0 for a 0.0 shows


@pytest.mark.parametrize("seed", range(4))
def test_padded_rows_are_the_one_by_one_writes(seed):
    samples, advantages = _samples(seed)
    indices = [3, 0, 7, 5, 11]
    mb = pad_microbatch(samples, indices, advantages, sequence_multiple=4, shape=(6, 16))
    want = new_rows(6, 16)
    for row, i in enumerate(indices):
        _one_by_one(want, row, 0, samples[i], advantages[i])
    _assert_bitwise(mb, want)


@pytest.mark.parametrize("seed", range(4))
def test_packed_rows_are_the_one_by_one_writes(seed):
    samples, advantages = _samples(seed)
    indices = [2, 9, 4, 1]
    length = sum(samples[i].length for i in indices) + 3  # a tail of padding
    mb = pack_row(samples, indices, advantages, length)
    want, start = new_rows(1, length), 0
    for i in indices:
        _one_by_one(want, 0, start, samples[i], advantages[i])
        start += samples[i].length
    _assert_bitwise(mb, want)
