"""The rollout correction against verl 0.9.1's own rollout_corr_helper: weights, masks and every
rollout_corr/ metric on random and adversarial batches; where BAPO sees it; tis_cap its alias."""

from __future__ import annotations

import ast
import math
import sys
import types
import zipfile
from unittest import mock

import pytest
import torch

from bapo_megatron.algo import rollout_corr_metrics as corr_metrics
from bapo_megatron.algo.bapo import BAPOConfig
from bapo_megatron.algo.losses import PolicyBatch, PolicyLossConfig, policy_loss
from bapo_megatron.algo.metrics import LossOutput, reduce_metrics
from bapo_megatron.algo.rollout_correction import (
    RS_OPTIONS,
    RolloutCorrectionConfig,
    Sequences,
    apply_correction,
    batch_mean_parts,
    normaliser,
)
from bapo_megatron.errors import ConfigError

HELPER = "verl/trainer/ppo/rollout_corr_helper.py"
VERL_F = ("masked_sum", "masked_mean", "distributed_masked_mean")
"""The functions of verl.utils.torch_functional the helper calls (that module's own imports need
tensordict, which the venv lacks: its functions are taken out of it, unchanged)."""


def _stub(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture(scope="module")
def verl():
    """verl's rollout_corr_helper, run unchanged: its imports met by verl's own torch_functional
    functions and, for what it only names in annotations (or wraps its weights in), stubs."""
    from tests.helpers import VERL_VERSION
    from tests.sglang_wheel import WheelUnavailable, wheel_path

    try:
        wheel = wheel_path("verl", VERL_VERSION)
    except WheelUnavailable as err:
        pytest.skip(str(err))
    with zipfile.ZipFile(wheel) as whl:
        helper, functional = whl.read(HELPER).decode(), whl.read("verl/utils/torch_functional.py").decode()
    verl_f = _stub("verl.utils.torch_functional", torch=torch)
    picked = [n for n in ast.parse(functional).body if isinstance(n, ast.FunctionDef) and n.name in VERL_F]
    assert len(picked) == len(VERL_F)
    exec(compile(ast.Module(body=picked, type_ignores=[]), "verl/utils/torch_functional.py", "exec"), verl_f.__dict__)

    class DataProto:  # the helper wraps its weights in one; the test reads them back
        @classmethod
        def from_dict(cls, tensors):
            proto = cls()
            proto.batch = tensors
            return proto

    config = _stub("verl.trainer.config.algorithm", RolloutCorrectionConfig=object)
    actor = _stub("verl.workers.config.actor", PolicyLossConfig=object)
    utils = _stub("verl.utils", torch_functional=verl_f)
    stubs = {
        "verl": _stub("verl", utils=utils),
        "verl.utils": utils,
        "verl.utils.torch_functional": verl_f,
        "verl.protocol": _stub("verl.protocol", DataProto=DataProto),
        "verl.trainer": _stub("verl.trainer"),
        "verl.trainer.config": _stub("verl.trainer.config", algorithm=config),
        "verl.trainer.config.algorithm": config,
        "verl.workers": _stub("verl.workers"),
        "verl.workers.config": _stub("verl.workers.config", actor=actor),
        "verl.workers.config.actor": actor,
    }
    module = types.ModuleType("rollout_corr_helper")
    with mock.patch.dict(sys.modules, stubs):
        exec(compile(helper, HELPER, "exec"), module.__dict__)
    return module


# ----------------------------------------------------------------------------------------------
# Batches: [rows, tokens] of log pi (the policy measured), log mu (the engine's) and the mask.


def _batch(kind: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    rows, width = 6, 9
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    if kind == "empty":  # responses of no token beside others
        lengths[::3] = 0
    elif kind == "one_token":
        lengths[:] = 1
    elif kind == "all_masked":
        lengths[:] = 0
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).float()
    train = -torch.rand(rows, width, generator=g) * 4.0
    gap = torch.randn(rows, width, generator=g) * (0.3 if kind != "random_wide" else 1.2)
    if kind == "extreme":  # gaps past the exp(+-20) safety bound, both ways
        gap[0, 0], gap[1, 0], gap[2, :2] = 35.0, -40.0, 25.0
    engine = train - gap
    nan = torch.full_like(train, float("nan"))  # padding may hold anything
    return torch.where(mask > 0, train, nan), torch.where(mask > 0, engine, nan), mask


KINDS = ("random", "random_wide", "empty", "one_token", "extreme")
CONFIGS = {
    "metrics_only": RolloutCorrectionConfig(),
    "token_tis": RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0),
    "token_icepop": RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.5_2.0"),
    "seq_tis_norm": RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_threshold=5.0, rollout_is_batch_normalize=True
    ),
    "seq_icepop_norm": RolloutCorrectionConfig(
        rollout_is="sequence", rollout_is_threshold="0.2_5.0", rollout_is_batch_normalize=True
    ),
    "token_norm_rs": RolloutCorrectionConfig(
        rollout_is="token",
        rollout_is_threshold=3.0,
        rollout_is_batch_normalize=True,
        rollout_rs="token_k1,seq_mean_k3",
        rollout_rs_threshold="0.5_2.0,0.05",
    ),
    "every_rs": RolloutCorrectionConfig(rollout_rs=",".join(RS_OPTIONS), rollout_rs_threshold=2.0),
    "seq_sum_k1": RolloutCorrectionConfig(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"),
}


def _ours(train, engine, mask, cfg: RolloutCorrectionConfig, splits: int = 1):
    """(weights, mask, metrics) as the trainer computes them: the rows in `splits` micro-batches,
    the batch-normalisation mean summed over them first (the prepass), the metrics reduced once."""
    chunks = list(zip(train.chunk(splits), engine.chunk(splits), mask.chunk(splits), strict=True))
    seqs = [Sequences.rows(m.shape, m.shape[0], m.device) for _, _, m in chunks]
    scale = None
    if cfg.rollout_is_batch_normalize:
        level = "token" if cfg.rollout_is == "token" else "sequence"
        parts = [
            batch_mean_parts(apply_correction(t, t, e, m, s, cfg, t.new_ones(())).correction, m, s, level)
            for (t, e, m), s in zip(chunks, seqs, strict=True)
        ]
        scale = normaliser(torch.stack(parts).sum(0))
    weights, masks, outs = [], [], []
    for (t, e, m), s in zip(chunks, seqs, strict=True):
        fixed = apply_correction(t, t, e, m, s, cfg, scale)
        out = LossOutput(loss_sum=t.new_zeros(()), token_count=t.new_zeros(()))
        corr_metrics.add_metrics(out, fixed, e, m, is_scale=scale)
        weights.append(torch.ones_like(t) if fixed.is_weight is None else fixed.is_weight)
        masks.append(fixed.mask)
        outs.append(out)
    return torch.cat(weights), torch.cat(masks), corr_metrics.finish(reduce_metrics(outs))


def _verl(verl, train, engine, mask, cfg: RolloutCorrectionConfig):
    proto, kept, metrics = verl.compute_rollout_correction_and_rejection_mask(
        old_log_prob=train,
        rollout_log_prob=engine,
        response_mask=mask,
        rollout_is=cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_batch_normalize=cfg.rollout_is_batch_normalize,
        rollout_rs=cfg.rollout_rs,
        rollout_rs_threshold=cfg.rollout_rs_threshold,
    )
    return None if proto is None else proto.batch["rollout_is_weights"], kept, metrics


def _close(ours: float, theirs: float) -> bool:
    if math.isinf(theirs) or math.isinf(ours):
        return ours == theirs
    return math.isclose(ours, theirs, rel_tol=2e-4, abs_tol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_weights_masks_and_metrics_equal_verls(verl, name, kind):
    cfg = CONFIGS[name]
    train, engine, mask = _batch(kind, seed=len(name) * 7 + len(kind))
    their_w, their_mask, theirs = _verl(verl, train, engine, mask, cfg)
    for splits in (1, 3):  # micro-batches add up to the whole batch
        w, kept, ours = _ours(train, engine, mask, cfg, splits)
        counted = mask > 0
        if their_w is not None:
            torch.testing.assert_close(w[counted], their_w[counted].to(w), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kept, their_mask.to(kept))
        missing = sorted(set(theirs) - set(ours))
        assert not missing, f"verl's metrics that we do not report: {missing}"
        wrong = {k: (ours[k], v) for k, v in theirs.items() if not _close(ours[k], float(v))}
        assert not wrong, f"{name}/{kind}, {splits} micro-batches: (ours, verl's) differ: {wrong}"


def test_the_comparison_can_fail(verl):
    """A metric off by a little is caught (the test above is not vacuous)."""
    cfg = CONFIGS["token_tis"]
    train, engine, mask = _batch("random", 1)
    _, _, theirs = _verl(verl, train, engine, mask, cfg)
    _, _, ours = _ours(train + 1e-3 * mask.nan_to_num(), engine, mask, cfg)
    assert not all(_close(ours[k], float(v)) for k, v in theirs.items())


def test_all_masked_batch_reports_zeros_where_verl_refuses(verl):
    train, engine, mask = _batch("all_masked", 0)
    cfg = CONFIGS["token_norm_rs"]
    with pytest.raises((ValueError, AssertionError)):
        _verl(verl, train, engine, mask, cfg)
    w, kept, ours = _ours(train, engine, mask, cfg, splits=2)
    assert not kept.any() and torch.isfinite(w).all()
    assert all(math.isfinite(v) for v in ours.values()), ours


def test_geometric_weight_is_the_mean_log_ratio_per_response():
    train, engine, mask = _batch("extreme", 3)
    cfg = RolloutCorrectionConfig(rollout_is="geometric", rollout_is_threshold="0.5_3.0")
    w, _, ours = _ours(train, engine, mask, cfg)
    for row in range(mask.shape[0]):
        n = int(mask[row].sum())
        mean = float((train[row, :n] - engine[row, :n]).mean())
        raw = math.exp(max(min(mean, 20.0), -20.0))
        expected = raw if 0.5 <= raw <= 3.0 else 0.0
        assert torch.allclose(w[row, :n], torch.tensor(expected), rtol=1e-5)
    assert "rollout_corr/rollout_is_oob_ratio" in ours


def test_staleness_split_and_nemo_rl_error():
    train, engine, mask = _batch("random", 5)
    same = torch.zeros_like(mask, dtype=torch.bool)
    same[:3] = True
    seqs = Sequences.rows(mask.shape, mask.shape[0], mask.device)
    fixed = apply_correction(train, train, engine, mask, seqs, RolloutCorrectionConfig())
    out = LossOutput(loss_sum=train.new_zeros(()), token_count=train.new_zeros(()))
    corr_metrics.add_metrics(out, fixed, engine, mask, same_version=same)
    metrics = corr_metrics.finish(reduce_metrics([out]))
    gap = (train - engine).abs()
    for suffix, where in (("", mask > 0), ("_same_version", (mask > 0) & same), ("_older", (mask > 0) & ~same)):
        assert metrics[f"rollout_corr/token_mult_prob_error{suffix}"] == pytest.approx(gap[where].exp().mean().item())
        assert metrics[f"rollout_corr/train_rollout_logprob_abs_diff{suffix}"] == pytest.approx(
            gap[where].mean().item()
        )
    out = LossOutput(loss_sum=train.new_zeros(()), token_count=train.new_zeros(()))
    corr_metrics.add_metrics(out, fixed, engine, mask, same_version=torch.ones_like(same))
    metrics = corr_metrics.finish(reduce_metrics([out]))
    assert "rollout_corr/token_mult_prob_error_same_version" in metrics
    assert "rollout_corr/token_mult_prob_error_older" not in metrics  # no older token: no figure


# ----------------------------------------------------------------------------------------------
# In the loss: where the correction applies, and what BAPO's search sees.


def _loss_batch(seed: int = 0, **kw) -> PolicyBatch:
    train, engine, mask = _batch("random_wide", seed)
    g = torch.Generator().manual_seed(seed + 1)
    logprobs = train + 0.2 * torch.randn(train.shape, generator=g)
    adv = torch.randn(train.shape[0], 1, generator=g).expand_as(train).contiguous()
    return PolicyBatch(logprobs=logprobs, old_logprobs=engine, advantages=adv, mask=mask, prox_logprobs=train, **kw)


def test_tis_cap_is_token_truncation_at_the_cap():
    """The alias: tis_cap C and rollout_is token with threshold C give the same loss and the same
    bounds, and both the loss today's tis_cap gave: sum_t m_t min(pi_prox / mu, C) loss_t."""
    batch = _loss_batch(2)
    for loss in ("bapo", "ppo", "cispo"):
        alias = policy_loss(batch, PolicyLossConfig(loss=loss, tis_cap=1.5))
        corr = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5)
        named = policy_loss(batch, PolicyLossConfig(loss=loss, rollout_correction=corr))
        torch.testing.assert_close(alias.loss_sum, named.loss_sum)
        assert reduce_metrics([alias]) == reduce_metrics([named])
        bounds = reduce_metrics([alias])
        plain = PolicyLossConfig(loss="ppo") if loss == "ppo" else None
        if plain is not None:  # today's formula, longhand
            counted = batch.mask > 0
            w = torch.exp(torch.clamp(batch.prox_logprobs - batch.old_logprobs, max=math.log(1.5)))
            r = torch.exp(batch.logprobs - batch.old_logprobs)
            a = batch.advantages
            v = torch.where(a > 0, a * r.clamp(max=1.2), a * r.clamp(min=0.8))
            expected = -(w * v)[counted].sum()
            torch.testing.assert_close(alias.loss_sum, expected)
            assert bounds["bapo/clip_high"] == 1.2
    with pytest.raises(ConfigError, match="tis_cap"):
        PolicyLossConfig(tis_cap=2.0, rollout_correction=RolloutCorrectionConfig(rollout_is="token"))


@pytest.mark.parametrize("loss", ["bapo", "ppo"])
def test_a_rejected_token_changes_neither_the_loss_nor_the_positive_share(loss):
    """Rejection takes a token out of the loss, the token count and BAPO's search: the same as
    the token masked out before the loss."""
    batch = _loss_batch(4)
    batch.old_logprobs = batch.old_logprobs.clone()
    batch.old_logprobs[1, 0] = batch.prox_logprobs[1, 0] + 8.0  # far outside the bounds: rejected
    corr = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.001_1000"
    )
    cfg = PolicyLossConfig(loss=loss, bapo=BAPOConfig(target_rho=0.45), rollout_correction=corr)
    rejected = policy_loss(batch, cfg)
    mask = batch.mask.clone()
    mask[1, 0] = 0.0
    without = policy_loss(PolicyBatch(**{**batch.__dict__, "mask": mask}), cfg)
    torch.testing.assert_close(rejected.loss_sum, without.loss_sum)
    torch.testing.assert_close(rejected.token_count, without.token_count)
    ours, theirs = reduce_metrics([rejected]), reduce_metrics([without])
    for name in ("bapo/rho", "bapo/clip_low", "bapo/clip_high", "policy/positive_loss", "policy/negative_loss"):
        assert ours[name] == pytest.approx(theirs[name]), name
    assert ours["rollout_corr/rollout_rs_masked_fraction"] > 0.0  # measured over every token given
    assert theirs["rollout_corr/rollout_rs_masked_fraction"] == 0.0


def test_the_search_weighs_tokens_as_the_loss_does():
    """BAPO's share is measured with the weights the loss multiplies: a correction that only
    halves one response's weight moves the share, as it moves the loss."""
    batch = _loss_batch(6)
    base = reduce_metrics([policy_loss(batch, PolicyLossConfig(loss="ppo"))])
    corr = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=1e-3)  # every weight 1e-3 or less
    low = reduce_metrics([policy_loss(batch, PolicyLossConfig(loss="ppo", rollout_correction=corr))])
    assert low["policy/positive_loss"] < 0.01 * abs(base["policy/positive_loss"]) + 1e-12


def test_bypass_mode_measures_the_current_policy_and_needs_no_prox():
    batch = _loss_batch(8)
    batch.prox_logprobs = None
    corr = RolloutCorrectionConfig(rollout_is="token", bypass_mode=True)
    out = reduce_metrics([policy_loss(batch, PolicyLossConfig(loss="ppo", rollout_correction=corr))])
    plain = reduce_metrics([policy_loss(batch, PolicyLossConfig(loss="ppo"))])
    assert out["loss/pg"] == pytest.approx(plain["loss/pg"])  # ppo_clip: the ratio is the weight, not applied twice
    gap = (batch.logprobs - batch.old_logprobs)[batch.mask > 0]
    assert out["rollout_corr/kl"] == pytest.approx(-gap.mean().item(), rel=1e-5)
    reinforce = RolloutCorrectionConfig(rollout_is="token", bypass_mode=True, loss_type="reinforce")
    out = policy_loss(batch, PolicyLossConfig(loss="ppo", rollout_correction=reinforce))
    counted = batch.mask > 0
    w = torch.exp(gap).clamp(max=2.0)
    expected = -(w * batch.advantages[counted] * batch.logprobs[counted]).sum()
    torch.testing.assert_close(out.loss_sum, expected)
    with pytest.raises(ValueError, match="prox_logprobs"):
        policy_loss(batch, PolicyLossConfig(loss="ppo", tis_cap=2.0))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"rollout_is_threshold": "2_0.5"}, "rollout_is_threshold='2_0.5': the lower bound"),
        ({"rollout_is_threshold": "abc"}, "number"),
        ({"rollout_is_threshold": 0.0}, "upper"),
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 2.0}, "token_k4"),
        ({"rollout_rs": "token_k2"}, "must be set"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "upper bound only"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "1,2,3"}, "one per option"),
        ({"loss_type": "reinforce"}, "bypass"),
        ({"bypass_mode": True, "rollout_is_batch_normalize": True}, "decoupled"),
    ],
)
def test_bad_settings_are_refused_with_their_name(fields, match):
    with pytest.raises(ConfigError, match=match) as err:
        RolloutCorrectionConfig(**fields)
    assert err.value.field in fields or err.value.field == "rollout_rs_threshold"  # named, as the loader prefixes it


def test_settings_that_cannot_work_together_are_refused():
    reinforce = RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce")
    with pytest.raises(ConfigError, match="must be ppo"):
        PolicyLossConfig(loss="bapo", rollout_correction=reinforce)
    with pytest.raises(ConfigError, match="loss sft"):
        PolicyLossConfig(loss="sft", rollout_correction=RolloutCorrectionConfig(rollout_is="token"))


def test_verl_threshold_forms_parse_as_verl_parses_them(verl):
    for spec in (2.0, "2.0", "0.5_2.0", 3, "0.999_1.001"):
        upper, lower = verl._parse_rollout_is_threshold(spec)
        assert RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=spec).is_bounds == (lower, upper)
    names = list(CONFIGS["every_rs"].rules)
    theirs = verl._parse_rollout_rs_thresholds([r.option for r in names], 2.0)
    assert {r.option: {"lower": r.lower, "upper": r.upper} for r in names} == theirs
    assert {r.option for r in names} == set(verl.SUPPORTED_ROLLOUT_RS_OPTIONS)


# ----------------------------------------------------------------------------------------------
# In the trainer.


def _trainer_worker(rank: int, world: int) -> None:
    from bapo_megatron.config import load_config
    from bapo_megatron.models.spec import tiny_spec
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from tests.helpers import make_batch

    activate_cpu_shim()
    token = ["algo.rollout_correction.rollout_is=token", "algo.rollout_correction.rollout_is_threshold=1.5"]
    runs = {"tis_cap": ["algo.tis_cap=1.5"], "token": token}
    metrics = {}
    for name, overrides in runs.items():  # the same seed: the same starting weights
        cfg = load_config(None, ["parallel.max_tokens_per_microbatch=48", *overrides])
        trainer = PolicyTrainer(tiny_spec(), cfg, init_model_parallel(cfg.parallel, cfg.seed))
        metrics[name] = trainer.train_step(make_batch(3)).metrics
    for key in ("loss/pg", "train/grad_norm", "bapo/clip_low", "bapo/clip_high", "rollout_corr/rollout_is_mean"):
        assert metrics["tis_cap"][key] == metrics["token"][key], key
    assert 0.0 < metrics["token"]["rollout_corr/rollout_is_mean"] != 1.0  # weights that change the loss
    assert metrics["token"]["rollout_corr/rollout_is_ratio_fraction_high"] > 0.0  # and the cap that cuts some


def test_the_trainer_trains_tis_cap_as_token_truncation():
    """Trainer-level: algo.tis_cap C and rollout_correction token truncation at C take the same step."""
    from tests.dist.launch import run_workers

    run_workers(_trainer_worker, 1)


def test_every_rollout_corr_key_a_plot_panel_names_is_written():
    """tools/plot_run.py's rollout_corr/ panels read names these metrics have (they are built from a
    prefix and suffixes, which the plot test's source search cannot see)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import plot_run

    train, engine, mask = _batch("random_wide", 3)
    same = torch.zeros_like(mask, dtype=torch.bool)
    same[: mask.shape[0] // 2] = True
    cfg = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold="0.5_2.0", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold=2.0
    )
    seqs = Sequences.rows(mask.shape, mask.shape[0], mask.device)
    fixed = apply_correction(train, train, engine, mask, seqs, cfg)
    out = LossOutput(loss_sum=train.new_zeros(()), token_count=train.new_zeros(()))
    corr_metrics.add_metrics(out, fixed, engine, mask, same_version=same)
    written = set(corr_metrics.finish(reduce_metrics([out])))
    wanted = {key for panel in plot_run.PANELS for key in panel.keys if key.startswith(corr_metrics.PREFIX)}
    assert wanted and wanted <= written, sorted(wanted - written)
