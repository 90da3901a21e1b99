"""On CUDA: the search equals the CPU plain loop, with one host synchronisation."""

import pytest
import torch

from bapo_megatron.algo.bapo import PRESETS, search_clip_bounds
from bapo_megatron.algo.bapo_reference import search_clip_bounds_reference
from bapo_megatron.algo.losses import PolicyBatch, PolicyLossConfig, policy_loss


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cuda_search_equals_cpu_loop(preset):
    g = torch.Generator().manual_seed(0)
    for n in (0, 1000, 3_000_000):
        ratio = torch.exp(torch.randn(n, generator=g) * 0.6)
        adv = torch.randn(n, generator=g) - 0.1
        mask = (torch.rand(n, generator=g) < 0.9).float()
        cfg = PRESETS[preset]
        got = search_clip_bounds(ratio.cuda(), adv.cuda(), mask.cuda(), cfg)
        want = search_clip_bounds_reference(ratio, adv, mask, cfg)
        assert (got.c_low, got.c_high, got.steps) == (want.c_low, want.c_high, want.steps)
        assert got.rho == pytest.approx(want.rho, rel=1e-9)


def test_cuda_loss_matches_cpu():
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(8, 512, generator=g) * 3
    lp = old + torch.randn(8, 512, generator=g) * 0.3
    adv = torch.randn(8, 1, generator=g).expand(8, 512).contiguous()
    mask = torch.ones(8, 512)
    cfg = PolicyLossConfig(loss="bapo")
    outs = []
    for device in ("cpu", "cuda"):
        x = lp.clone().to(device).requires_grad_()  # a leaf on each device
        out = policy_loss(
            PolicyBatch(logprobs=x, old_logprobs=old.to(device), advantages=adv.to(device), mask=mask.to(device)), cfg
        )
        (out.loss_sum / out.token_count).backward()
        outs.append((out.loss_sum.item(), x.grad.cpu()))
    assert outs[0][0] == pytest.approx(outs[1][0], rel=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-7)
