"""The train-rollout log-prob gap has one name, rollout_corr/train_rollout_logprob_abs_diff (and its
_same_version and _older splits): it gives what the removed rollout/logprob_mismatch and
rollout/logprob_mismatch_same_version gave, only on a batch's first update, and a config that
still bounds an old name, or a name no step reports, is refused."""

import pytest
import torch

from bapo_megatron.algo.losses import PolicyBatch, PolicyLossConfig, policy_loss
from bapo_megatron.algo.metrics import reduce_metrics
from bapo_megatron.algo.rollout_corr_metrics import ABS_DIFF, MISMATCH_METRICS, finish
from bapo_megatron.algo.rollout_correction import RolloutCorrectionConfig
from bapo_megatron.config.run import RENAMED_METRICS, RunChecksConfig
from bapo_megatron.errors import ConfigError

DECOUPLED_TIS = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)


def _batch(first_update: bool = True, prox: bool = False) -> PolicyBatch:
    """A rollout batch with prompt and padding positions (NaN behaviour log-probs there) and tokens
    of two policy versions; `prox`: the start-of-step pi_prox, which on a first update holds the
    weights of the training forward."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(6, 10, generator=g) * 3
    logprobs = (old + 0.3 * torch.randn(6, 10, generator=g)).clamp(max=0.0)
    mask = torch.ones(6, 10)
    mask[:, :3] = 0
    mask[2, 7:] = 0
    old[mask == 0] = torch.nan
    return PolicyBatch(
        logprobs=logprobs.requires_grad_(),
        old_logprobs=old,
        advantages=torch.randn(6, 1, generator=g).expand(6, 10).contiguous(),
        mask=mask,
        prox_logprobs=logprobs.detach().clone() if prox else None,
        first_update=first_update,
        same_version=torch.arange(6)[:, None].expand(6, 10) < 4,
    )


def _metrics(batch: PolicyBatch, cfg: PolicyLossConfig) -> dict[str, float]:
    return finish(reduce_metrics([policy_loss(batch, cfg)]))


@pytest.mark.parametrize("mode", ["no correction", "decoupled token TIS", "bypass"])
def test_the_first_update_reports_what_the_removed_metrics_gave(mode):
    """Where their definitions agree (a 0/1 loss mask, the first update: pi_prox holds the training
    forward's weights), the new names give the old formulas' values: the loss-weighted mean
    |log pi - log mu| over the counted tokens, and its unweighted mean over the tokens of the
    step's own version."""
    corr = {
        "no correction": RolloutCorrectionConfig(),
        "decoupled token TIS": DECOUPLED_TIS,
        "bypass": RolloutCorrectionConfig(bypass_mode=True),
    }[mode]
    batch = _batch(prox=mode != "bypass")
    m = _metrics(batch, PolicyLossConfig(loss="ppo", rollout_correction=corr))
    counted = batch.mask != 0
    w = batch.mask
    diff = torch.where(counted, (batch.logprobs.detach() - batch.old_logprobs).abs(), 0.0)
    old_all = (w * diff).sum() / w.sum()  # rollout/logprob_mismatch (algo/losses.py)
    same = batch.same_version & counted
    old_same = (diff * same).sum() / same.sum()  # rollout/logprob_mismatch_same_version (the trainer)
    assert m[ABS_DIFF] == pytest.approx(old_all.item(), rel=1e-6)
    assert m[ABS_DIFF + "_same_version"] == pytest.approx(old_same.item(), rel=1e-6)
    assert not {"rollout/logprob_mismatch", "rollout/logprob_mismatch_same_version"} & set(m)


def test_later_updates_of_a_batch_report_no_train_rollout_gap():
    """A later update's weights moved since the engine sampled: its gap would be training drift, and
    averaged into the step's figure it would hide the engine's. The correction's own figures stay."""
    cfg = PolicyLossConfig(loss="ppo", rollout_correction=DECOUPLED_TIS)
    later = _metrics(_batch(first_update=False, prox=True), cfg)
    assert not any(k.startswith((ABS_DIFF, "rollout_corr/token_mult_prob_error")) for k in later), sorted(later)
    assert {"rollout_corr/kl", "rollout_corr/rollout_is_mean"} <= set(later)


def test_every_metric_the_mismatch_bound_may_name_is_reported_on_a_first_update():
    m = _metrics(_batch(prox=True), PolicyLossConfig(loss="ppo", rollout_correction=DECOUPLED_TIS))
    assert set(MISMATCH_METRICS) <= set(m)
    assert RunChecksConfig().mismatch_metrics == (ABS_DIFF + "_same_version",)


@pytest.mark.parametrize("old", sorted(RENAMED_METRICS))
def test_a_carried_config_that_bounds_a_removed_name_is_told_the_new_one(old):
    with pytest.raises(ConfigError, match=f"mismatch_metrics=.*{old} is now called {RENAMED_METRICS[old]}$"):
        RunChecksConfig(enabled=True, max_logprob_mismatch=1e-5, mismatch_metrics=(old,))
    RunChecksConfig(mismatch_metrics=(old,))  # unbounded (the default): nothing reads it


@pytest.mark.parametrize("name", [ABS_DIFF + "_same_versions", "rollout_corr/kl"])
def test_a_bound_on_a_name_that_is_no_reported_log_prob_difference_is_refused(name):
    with pytest.raises(ConfigError, match=f"{name} is none of the bounded metrics: {ABS_DIFF}, "):
        RunChecksConfig(max_logprob_mismatch=1e-5, mismatch_metrics=(ABS_DIFF, name))
