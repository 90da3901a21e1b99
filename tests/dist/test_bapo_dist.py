"""BAPO across data-parallel ranks (gloo, CPU): one collective, the same bounds everywhere."""

import itertools

import pytest
import torch
import torch.distributed as dist

from bapo_megatron.algo.bapo import BAPOConfig, search_clip_bounds
from bapo_megatron.algo.bapo_reference import search_clip_bounds_reference
from bapo_megatron.algo.losses import PolicyBatch, PolicyLossConfig, policy_loss
from bapo_megatron.algo.metrics import reduce_metrics
from bapo_megatron.errors import NonFiniteInputError
from tests.dist.launch import count_collectives, run_workers

TOKENS = (37, 0, 260, 5)  # unequal per rank; one rank has none


def _rank_tokens(rank: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    n = TOKENS[rank]
    ratio = torch.exp(torch.randn(n, generator=g) * 0.7)
    adv = torch.randn(n, generator=g) - 0.1
    mask = (torch.rand(n, generator=g) < 0.9).float()
    return ratio, adv, mask


def _concat(ranks, seed):
    parts = [_rank_tokens(r, seed) for r in ranks]
    return [torch.cat(x) for x in zip(*parts, strict=True)]


def _configs():
    for i, (contribution, order, dual) in enumerate(
        itertools.product(("loss", "gradient"), ("paper", "lower_first"), (None, 2.0))
    ):
        # Targets around the data's share, so that searches stop at many different points.
        yield (
            i,
            BAPOConfig(contribution=contribution, search_order=order, dual_clip=dual, target_rho=0.3 + 0.05 * (i % 5)),
        )


def _same_bounds(got, want):
    assert (got.c_low, got.c_high, got.steps) == (want.c_low, want.c_high, want.steps), (got, want)
    assert got.rho == pytest.approx(want.rho, rel=1e-12, abs=1e-15)


def _search_worker(rank: int, world: int) -> None:
    everyone = dist.new_group(list(range(world)))
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])] if world == 4 else []
    for seed, cfg in _configs():
        mine = _rank_tokens(rank, seed)
        with count_collectives() as calls:
            got = search_clip_bounds(*mine, cfg, group=everyone)
        assert [name for name, _ in calls] == ["all_reduce"], calls
        assert calls[0][1] is everyone  # the group it was given, never WORLD by default
        _same_bounds(got, search_clip_bounds_reference(*_concat(range(world), seed), cfg))
        # Every rank holds the same answer, bit for bit.
        gathered = [None] * world
        dist.all_gather_object(gathered, got, group=everyone)
        assert all(g == got for g in gathered)
        if halves:
            members = [0, 1] if rank < 2 else [2, 3]
            got = search_clip_bounds(*mine, cfg, group=halves[rank // 2])
            _same_bounds(got, search_clip_bounds_reference(*_concat(members, seed), cfg))


def _loss_worker(rank: int, world: int) -> None:
    """bound_scope 'microbatch': the loss searches over its group; metrics reduce to the global values."""
    everyone = dist.new_group(list(range(world)))
    cfg = PolicyLossConfig(loss="bapo", bapo=BAPOConfig(target_rho=0.42, bound_scope="microbatch"))

    def batch(ranks):
        # a rank's tokens are one response, a row padded to the longest (masked): the single process
        # holds the same responses, so the sequence-level metrics (rollout_corr/) compare too
        rows = [_rank_tokens(r, seed=99) for r in ranks]
        pad = max(TOKENS) - torch.tensor([len(x[0]) for x in rows]).unsqueeze(1)
        ratio, adv, mask = (
            torch.stack([torch.cat([x[i], torch.full((int(p),), fill)]) for x, p in zip(rows, pad, strict=True)])
            for i, fill in enumerate((1.0, 0.0, 0.0))
        )
        logprobs = torch.zeros(ratio.shape)  # only the ratio pi / mu matters
        return PolicyBatch(logprobs=logprobs, old_logprobs=-ratio.log(), advantages=adv, mask=mask)

    local = policy_loss(batch([rank]), cfg, group=everyone)
    single = policy_loss(batch(range(world)), cfg)
    total = local.loss_sum.clone()
    dist.all_reduce(total, group=everyone)
    assert total.item() == pytest.approx(single.loss_sum.item(), rel=1e-6, abs=1e-9)
    with count_collectives() as calls:
        distributed = reduce_metrics([local], group=everyone)
    assert len(calls) == 2 and all(group is everyone for _, group in calls)
    expected = reduce_metrics([single])
    assert distributed.keys() == expected.keys()
    for name in expected:
        assert distributed[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-9), name


def _error_worker(rank: int, world: int) -> None:
    """A NaN on one rank makes every rank raise (after the one reduction), so none hangs."""
    everyone = dist.new_group(list(range(world)))
    ratio, adv, mask = (torch.ones(4), torch.ones(4), torch.ones(4))
    if rank == 1:
        ratio = torch.tensor([1.0, 1.0, float("nan"), 1.0])
    with pytest.raises(NonFiniteInputError, match="1 counted tokens have a non-finite or negative ratio"):
        search_clip_bounds(ratio, adv, mask, BAPOConfig(), group=everyone)
    dist.barrier(group=everyone)  # all ranks still in step


def _all_checks(rank: int, world: int) -> None:
    _search_worker(rank, world)
    _loss_worker(rank, world)
    _error_worker(rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_bapo_across_ranks(world):
    run_workers(_all_checks, world)
