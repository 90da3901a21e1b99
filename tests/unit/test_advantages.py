"""Group-relative advantages against their definitions."""

import pytest
import torch

from bapo_megatron.algo.advantages import AdvantageConfig, group_advantages, token_advantages
from bapo_megatron.errors import ConfigError


def test_estimators_match_definitions():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.4, 0.4, 0.1]], dtype=torch.float64)
    mean = rewards.mean(1, keepdim=True)
    grpo, _ = group_advantages(rewards, AdvantageConfig(estimator="grpo", std_eps=1e-6))
    torch.testing.assert_close(grpo, (rewards - mean) / (rewards.std(1, keepdim=True) + 1e-6))
    dr, _ = group_advantages(rewards, AdvantageConfig(estimator="dr_grpo"))
    torch.testing.assert_close(dr, rewards - mean)
    rloo, _ = group_advantages(rewards, AdvantageConfig(estimator="rloo"))
    for g in range(2):
        for i in range(5):
            others = torch.cat([rewards[g, :i], rewards[g, i + 1 :]])
            assert rloo[g, i].item() == pytest.approx((rewards[g, i] - others.mean()).item())


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_identical_rewards_give_exactly_zero_and_are_counted(estimator):
    rewards = torch.tensor([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [0.7, 0.7, 0.7]])
    adv, metrics = group_advantages(rewards, AdvantageConfig(estimator=estimator))
    assert (adv[0] == 0).all() and (adv[2] == 0).all() and (adv[1] != 0).all()
    assert metrics["advantage/zero_groups"] == 2
    assert metrics["advantage/zero_group_frac"] == pytest.approx(2 / 3)
    assert adv.dtype == rewards.dtype


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"\[num_groups, group_size\]"):
        group_advantages(torch.zeros(6), AdvantageConfig())
    with pytest.raises(ConfigError, match="group_size=1"):
        group_advantages(torch.zeros(3, 1), AdvantageConfig())
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[1.0, float("nan")]]), AdvantageConfig())
    with pytest.raises(ConfigError, match="estimator='ppo'"):
        AdvantageConfig(estimator="ppo")


def test_token_advantages_broadcast_under_the_mask():
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    out = token_advantages(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 2.0], [0.0, 0.0, -1.0]]))
    with pytest.raises(ValueError, match="advantages"):
        token_advantages(torch.ones(3), mask)
