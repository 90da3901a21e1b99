"""Every policy loss and its gradient equal the formula written out token by token in float64."""

import math

import pytest
import torch

from bapo_megatron.algo.bapo import BAPOConfig, ClipBounds
from bapo_megatron.algo.bapo_reference import search_clip_bounds_reference
from bapo_megatron.algo.losses import (
    POLICY_LOSSES,
    PolicyBatch,
    PolicyLossConfig,
    clipped_surrogate_loss,
    policy_loss,
)
from bapo_megatron.algo.metrics import reduce_metrics

B, S = 4, 9


def _batch(seed: int, tis: bool = False, wide: bool = True) -> PolicyBatch:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=g, dtype=torch.float64) * 3
    spread = 1.0 if wide else 0.1
    logprobs = (old + torch.randn(B, S, generator=g, dtype=torch.float64) * spread).clamp(max=0.0)
    adv = torch.randn(B, generator=g, dtype=torch.float64).unsqueeze(1).expand(B, S).clone()
    adv[0] = 0.0
    mask = torch.ones(B, S, dtype=torch.float64)
    mask[:, :2] = 0  # prompt
    mask[1, 6:] = 0  # padding
    old[mask == 0] = math.nan  # the engine reports nothing there
    prox = old + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.3 if tis else None
    entropy = torch.rand(B, S, generator=g, dtype=torch.float64)
    return PolicyBatch(
        logprobs=logprobs.requires_grad_(),
        old_logprobs=old,
        advantages=adv,
        mask=mask,
        prox_logprobs=prox,
        entropy=entropy,
    )


def _tis(batch: PolicyBatch, cfg: PolicyLossConfig, i: int, j: int) -> float:
    if cfg.tis_cap is None:
        return 1.0
    return min(math.exp(float(batch.prox_logprobs[i, j] - batch.old_logprobs[i, j])), cfg.tis_cap)


def _surrogate(r, a: float, c_low: float, c_high: float, dual: float | None):
    """-v_t written out with Python branches."""
    if a > 0:
        return -a * (r if r < c_high else c_high)
    if a < 0:
        loss = -a * (r if r > c_low else c_low)
        if dual is not None and loss > -dual * a:
            loss = -dual * a
        return loss
    return 0.0 * r


def _longhand(batch: PolicyBatch, cfg: PolicyLossConfig, bounds: ClipBounds | None):
    """The step's token-mean loss, one token at a time, gradient through autograd."""
    lp = batch.logprobs
    total, count = 0.0, 0.0
    seq_ratio = {}
    if cfg.loss == "gspo":
        for i in range(B):
            terms = [lp[i, j] - batch.old_logprobs[i, j] for j in range(S) if batch.mask[i, j]]
            mean = sum(terms) / len(terms)
            seq_ratio[i] = torch.exp(torch.clamp(mean, -20, 20))
    for i in range(B):
        for j in range(S):
            if not batch.mask[i, j]:
                continue
            a = float(batch.advantages[i, j])
            r = torch.exp(torch.clamp(lp[i, j] - batch.old_logprobs[i, j], -20, 20))
            if cfg.loss == "bapo":
                loss = _surrogate(r, a, bounds.c_low, bounds.c_high, cfg.bapo.dual_clip)
            elif cfg.loss == "ppo":
                loss = _surrogate(r, a, 1 - cfg.ppo_eps, 1 + cfg.ppo_eps, None)
            elif cfg.loss == "clip_higher":
                loss = _surrogate(r, a, cfg.clip_higher_low, cfg.clip_higher_high, None)
            elif cfg.loss == "dual_clip":
                loss = _surrogate(r, a, 1 - cfg.ppo_eps, 1 + cfg.ppo_eps, cfg.dual_clip_c)
            elif cfg.loss == "gspo":
                loss = _surrogate(seq_ratio[i], a, 1 - cfg.gspo_eps_low, 1 + cfg.gspo_eps_high, None)
            else:  # cispo
                weight = min(float(r.detach()), 1 + cfg.cispo_eps_high)
                loss = -weight * a * lp[i, j]
            total = total + _tis(batch, cfg, i, j) * loss
            count += 1
    return total / count


def _bapo_bounds(batch: PolicyBatch, cfg: PolicyLossConfig) -> ClipBounds:
    counted = batch.mask != 0
    log_ratio = torch.where(counted, batch.logprobs.detach() - batch.old_logprobs, 0.0).clamp(-20, 20)
    weight = batch.mask.clone()
    if cfg.tis_cap is not None:
        weight = weight * torch.where(counted, (batch.prox_logprobs - batch.old_logprobs).exp(), 0).clamp(
            max=cfg.tis_cap
        )
    return search_clip_bounds_reference(log_ratio.exp(), batch.advantages, weight, cfg.bapo)


CONFIGS = [
    PolicyLossConfig(loss=name, tis_cap=tis, bapo=BAPOConfig(target_rho=0.5, dual_clip=dual))
    for name in POLICY_LOSSES
    if name != "sft"  # no ratio and no advantage: test_sft_loss_is_the_token_cross_entropy
    for tis in (None, 2.0)
    for dual in ((None, 2.5) if name == "bapo" else (None,))
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.loss}-tis{c.tis_cap}-dual{c.bapo.dual_clip}")
@pytest.mark.parametrize("seed", range(4))
def test_loss_and_gradient_equal_longhand_formula(cfg, seed):
    _check_against_longhand(_batch(seed, tis=cfg.tis_cap is not None, wide=seed % 2 == 0), cfg)


@pytest.mark.parametrize("dual", [None, 2.5])
def test_bapo_stopping_mid_path_equals_longhand(dual):
    batch = _batch(0)
    cfg = PolicyLossConfig(loss="bapo", bapo=BAPOConfig(target_rho=0.37, dual_clip=dual))
    bounds = _check_against_longhand(batch, cfg)
    assert 0 < bounds.steps < 51 and bounds.c_high > 1.2


def _check_against_longhand(batch: PolicyBatch, cfg: PolicyLossConfig) -> ClipBounds | None:
    out = policy_loss(batch, cfg)
    loss = out.loss_sum / out.token_count
    (grad,) = torch.autograd.grad(loss, batch.logprobs)

    expected_bounds = _bapo_bounds(batch, cfg) if cfg.loss == "bapo" else None
    expected = _longhand(batch, cfg, expected_bounds)
    (expected_grad,) = torch.autograd.grad(expected, batch.logprobs)

    assert out.token_count.item() == batch.mask.sum().item()
    torch.testing.assert_close(loss, expected.to(loss.dtype), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(grad).all()  # NaN at masked positions never leaks
    assert grad[batch.mask == 0].abs().sum() == 0
    return expected_bounds


def test_bapo_with_given_bounds_uses_them():
    batch = _batch(0)
    cfg = PolicyLossConfig(loss="bapo")
    bounds = ClipBounds(c_low=0.7, c_high=2.0, rho=0.5, rho_start=0.3, steps=16)
    out = policy_loss(batch, cfg, bounds=bounds)
    expected = _longhand(batch, cfg, bounds)
    torch.testing.assert_close(out.loss_sum / out.token_count, expected)
    metrics = reduce_metrics([out])
    assert metrics["bapo/clip_low"] == 0.7 and metrics["bapo/clip_high"] == 2.0
    assert metrics["bapo/search_steps"] == 16 and metrics["bapo/rho_start"] == 0.3


def test_metrics_have_the_spec_names_and_values():
    batch = _batch(2)
    out = policy_loss(batch, PolicyLossConfig(loss="ppo"))
    m = reduce_metrics([out])
    spec = {
        "bapo/clip_low",
        "bapo/clip_high",
        "bapo/rho",
        "bapo/rho_start",
        "bapo/search_steps",
        "bapo/clipfrac_low",
        "bapo/clipfrac_high",
        "policy/entropy",
        "policy/ratio_mean",
        "policy/ratio_max",
        "rollout_corr/train_rollout_logprob_abs_diff",
        "loss/pg",
    }
    assert spec <= set(m)
    counted = batch.mask != 0
    ratio = (batch.logprobs.detach() - batch.old_logprobs).exp()[counted]
    adv = batch.advantages[counted]
    assert m["policy/ratio_mean"] == pytest.approx(ratio.mean().item())
    assert m["policy/ratio_max"] == pytest.approx(ratio.max().item())
    assert m["policy/entropy"] == pytest.approx(batch.entropy[counted].mean().item())
    assert m["bapo/clipfrac_high"] == pytest.approx(((adv > 0) & (ratio > 1.2)).double().mean().item())
    assert m["bapo/clipfrac_low"] == pytest.approx(((adv < 0) & (ratio < 0.8)).double().mean().item())
    assert m["rollout_corr/train_rollout_logprob_abs_diff"] == pytest.approx(ratio.log().abs().mean().item())
    assert m["loss/pg"] == pytest.approx((out.loss_sum / out.token_count).item())
    pos = torch.where(adv > 0, adv * ratio.clamp(max=1.2), 0).sum()
    neg = torch.where(adv < 0, -adv * ratio.clamp(min=0.8), 0).sum()
    assert m["bapo/rho"] == pytest.approx((pos / (pos + neg)).item())


@pytest.mark.parametrize("name", ["ppo", "clip_higher", "bapo", "bapo-gradient"])
def test_negative_token_and_positive_loss_shares_are_measured_alike_for_every_method(name):
    """The study compares methods on these two: counted tokens with A < 0, and P / (P + N) on the
    loss at the bounds the step used, whichever contribution measure BAPO searches with."""
    batch = _batch(4)  # advantages of both signs
    loss = "bapo" if name.startswith("bapo") else name
    cfg = PolicyLossConfig(loss=loss, bapo=BAPOConfig(contribution="gradient" if "gradient" in name else "loss"))
    from bapo_megatron.train import shares

    m = reduce_metrics([policy_loss(batch, cfg)])
    m |= shares(m)
    counted = batch.mask != 0
    ratio = (batch.logprobs.detach() - batch.old_logprobs).exp()[counted]
    adv = batch.advantages[counted]
    c_low, c_high = m["bapo/clip_low"], m["bapo/clip_high"]
    pos = torch.where(adv > 0, adv * ratio.clamp(max=c_high), 0).sum()
    neg = torch.where(adv < 0, -adv * ratio.clamp(min=c_low), 0).sum()
    assert m["policy/positive_loss_share"] == pytest.approx((pos / (pos + neg)).item())
    assert m["policy/negative_token_share"] == pytest.approx(((adv < 0).sum() / (adv != 0).sum()).item())
    assert (adv == 0).any()  # tokens without an advantage are left out of the token share
    assert 0 < m["policy/positive_loss_share"] < 1 and 0 < m["policy/negative_token_share"] < 1
    if name == "bapo-gradient":  # its own rho measures only the tokens the bounds let through
        assert m["bapo/rho"] != pytest.approx(m["policy/positive_loss_share"])
    # an update whose groups carry no advantage (all right or all wrong) adds nothing to the step's
    # shares: they come from the parts averaged over the updates, not from a 0/0 of its own
    silent = PolicyBatch(**{**batch.__dict__, "advantages": torch.zeros_like(batch.advantages)})
    none = reduce_metrics([policy_loss(silent, cfg)])
    assert shares(none) == {}
    both = {k: (m[k] + none[k]) / 2 for k in none}
    assert shares(both) == pytest.approx({k: m[k] for k in shares(both)})


def test_metrics_reduce_as_a_global_mean_over_microbatches():
    """Splitting a batch in micro-batches changes no metric and no summed loss."""
    batch = _batch(1)
    cfg = PolicyLossConfig(loss="clip_higher")
    whole = policy_loss(batch, cfg)
    parts = [
        policy_loss(
            PolicyBatch(**{k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in batch.__dict__.items()}), cfg
        )
        for rows in (slice(0, 1), slice(1, 4))
    ]
    assert sum(p.loss_sum for p in parts).item() == pytest.approx(whole.loss_sum.item())
    split, single = reduce_metrics(parts), reduce_metrics([whole])
    assert split.keys() == single.keys()
    for name in single:
        assert split[name] == pytest.approx(single[name], rel=1e-9, abs=1e-12), name


def test_clipped_surrogate_is_min_of_clipped_and_unclipped():
    g = torch.Generator().manual_seed(0)
    r = torch.exp(torch.randn(1000, generator=g, dtype=torch.float64))
    a = torch.randn(1000, generator=g, dtype=torch.float64)
    a[::7] = 0
    v = -clipped_surrogate_loss(r, a, 0.7, 1.4)
    torch.testing.assert_close(v, torch.minimum(r * a, r.clamp(0.7, 1.4) * a))


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(2, 3\)"):
        PolicyBatch(
            logprobs=torch.zeros(2, 4),
            old_logprobs=torch.zeros(2, 3),
            advantages=torch.zeros(2, 4),
            mask=torch.ones(2, 4),
        )
    with pytest.raises(ValueError, match="prox_logprobs"):
        policy_loss(_batch(0), PolicyLossConfig(loss="ppo", tis_cap=2.0))
    with pytest.raises(ValueError, match="loss='ppo2'"):
        PolicyLossConfig(loss="ppo2")
    with pytest.raises(ValueError, match=r"tis_cap=0\.5"):
        PolicyLossConfig(tis_cap=0.5)
    batch = _batch(0)
    flat = PolicyBatch(
        logprobs=batch.logprobs.reshape(-1),
        old_logprobs=batch.old_logprobs.reshape(-1),
        advantages=batch.advantages.reshape(-1),
        mask=batch.mask.reshape(-1),
    )
    with pytest.raises(ValueError, match="segment_ids"):
        policy_loss(flat, PolicyLossConfig(loss="gspo"))


def test_gspo_segment_ids_match_rows():
    batch = _batch(3)
    cfg = PolicyLossConfig(loss="gspo")
    by_rows = policy_loss(batch, cfg)
    segments = torch.arange(B).unsqueeze(1).expand(B, S).reshape(1, -1) * 10  # packed, ids need not be dense
    packed = PolicyBatch(
        logprobs=batch.logprobs.reshape(1, -1),
        old_logprobs=batch.old_logprobs.reshape(1, -1),
        advantages=batch.advantages.reshape(1, -1),
        mask=batch.mask.reshape(1, -1),
        segment_ids=segments,
    )
    torch.testing.assert_close(policy_loss(packed, cfg).loss_sum, by_rows.loss_sum)


def test_sft_loss_is_the_token_cross_entropy():
    g = torch.Generator().manual_seed(3)
    logprobs = (-torch.rand(4, 9, generator=g) * 3).requires_grad_()
    mask = (torch.rand(4, 9, generator=g) < 0.7).float()
    batch = PolicyBatch(
        logprobs=logprobs,
        old_logprobs=torch.full((4, 9), float("nan")),  # never read
        advantages=torch.full((4, 9), float("nan")),
        mask=mask,
    )
    out = policy_loss(batch, PolicyLossConfig(loss="sft"))
    (out.loss_sum / out.token_count).backward()
    want = -(logprobs.detach() * mask).sum() / mask.sum()
    torch.testing.assert_close(out.loss_sum / out.token_count, want)
    torch.testing.assert_close(logprobs.grad, -mask / mask.sum())
    assert reduce_metrics([out])["loss/sft"] == pytest.approx(want.item())


def test_sft_reports_greedy_token_and_answer_accuracy():
    """answer_acc counts the rows whose every counted token is the greedy one; a row without
    counted tokens is no answer; a wrong token outside the mask does not count."""
    logprobs = torch.full((4, 5), -0.1)
    top = logprobs.clone()
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0]]).float()
    top[1, 2] = -0.05  # row 1: one counted token is not the argmax
    top[2, 0] = -0.01  # row 2: only a prompt position differs
    batch = PolicyBatch(
        logprobs=logprobs,
        old_logprobs=torch.zeros(4, 5),
        advantages=torch.zeros(4, 5),
        mask=mask,
        top_logprobs=top,
    )
    metrics = reduce_metrics([policy_loss(batch, PolicyLossConfig(loss="sft"))])
    assert metrics["sft/answer_acc"] == pytest.approx(2 / 3)
    assert metrics["sft/token_acc"] == pytest.approx(7 / 8)


# ----------------------------------------------------------------------------------------------
# The KL loss to a reference policy and the entropy bonus.

VERL_NAMES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl", "abs": "abs", "k1+": "k1+", "k3+": "low_var_kl+"}
"""Our kl_type -> the name verl's actor.kl_loss_type gives the same estimate."""


def _verl_kl_penalty():
    """verl's kl_penalty (and the kl_penalty_forward it calls) from its released wheel's
    core_algos.py, run unchanged: only these two functions are taken, the module's other imports
    need verl installed."""
    import ast
    import zipfile

    from tests.helpers import VERL_VERSION
    from tests.sglang_wheel import WheelUnavailable, wheel_path

    try:
        wheel = wheel_path("verl", VERL_VERSION)
    except WheelUnavailable as err:
        pytest.skip(str(err))
    path = "verl/trainer/ppo/core_algos.py"
    with zipfile.ZipFile(wheel) as whl:
        tree = ast.parse(whl.read(path).decode())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("kl_penalty", "kl_penalty_forward")]
    assert len(wanted) == 2, f"verl {VERL_VERSION}'s {path} no longer defines kl_penalty and kl_penalty_forward"
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), f"verl-{VERL_VERSION}/{path}", "exec"), namespace)
    return namespace["kl_penalty"]


def test_kl_estimates_equal_verls_kl_penalty():
    """Each kl_type gives verl's kl_penalty of the same name, value and gradient, on log-ratios from
    tiny to past both clamps (|d| > 20 and a k3 above 10)."""
    from bapo_megatron.algo.losses import KL_ESTIMATES, VERL_KL_TYPES, kl_estimate

    verl = _verl_kl_penalty()
    assert set(VERL_NAMES) == set(KL_ESTIMATES)
    assert {VERL_KL_TYPES.get(name, name) for name in VERL_NAMES.values()} == set(KL_ESTIMATES)
    g = torch.Generator().manual_seed(0)
    ref = -torch.rand(400, generator=g, dtype=torch.float64) * 8
    d = torch.cat(
        [torch.randn(392, generator=g, dtype=torch.float64) * 3, torch.tensor([0.0, 1e-9, -4, 4, -25, 25, -12, 30])]
    )
    for ours, theirs in VERL_NAMES.items():
        mine = (ref + d).requires_grad_()
        want = (ref + d).requires_grad_()
        got, expected = kl_estimate(mine, ref, ours), verl(want, ref, theirs)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=ours)
        (grad,) = torch.autograd.grad(got.sum(), mine)
        (expected_grad,) = torch.autograd.grad(expected.sum(), want)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12, msg=ours)
    assert kl_estimate(ref, ref, "k3").abs().max() == 0  # the policy is the reference: no KL


def _with(batch: PolicyBatch, **fields) -> PolicyBatch:
    return PolicyBatch(**{**batch.__dict__, **fields})


@pytest.mark.parametrize("loss", ["bapo", "ppo", "gspo", "sft"])
@pytest.mark.parametrize("kl_type", ["k1", "k3", "k3+"])
def test_kl_and_entropy_terms_are_token_means_over_the_loss_tokens(loss, kl_type):
    """With kl_coef and entropy_coef the loss is the policy loss + kl_coef x mean KL - entropy_coef x
    mean entropy, every mean over the policy term's counted tokens (the same token_count, so the
    step's one division stays right), gradients included; loss/kl reports the mean KL; masked
    positions (NaN there) take no part."""
    from bapo_megatron.algo.losses import kl_estimate

    base = _batch(5)
    g = torch.Generator().manual_seed(1)
    ref = base.logprobs.detach() + torch.randn(B, S, generator=g, dtype=torch.float64) * 0.5
    ref[base.mask == 0] = math.nan
    entropy = base.entropy.clone().requires_grad_()
    batch = _with(base, ref_logprobs=ref, entropy=entropy)
    bounds = ClipBounds(c_low=0.7, c_high=2.0, rho=0.5, rho_start=0.3, steps=16) if loss == "bapo" else None
    plain_cfg = PolicyLossConfig(loss=loss)
    cfg = PolicyLossConfig(loss=loss, kl_coef=0.3, kl_type=kl_type, entropy_coef=0.02)
    plain, out = policy_loss(batch, plain_cfg, bounds=bounds), policy_loss(batch, cfg, bounds=bounds)

    counted = batch.mask != 0
    kl = kl_estimate(batch.logprobs[counted], ref[counted], kl_type)
    count = counted.sum()
    want = plain.loss_sum / plain.token_count + 0.3 * kl.sum() / count - 0.02 * entropy[counted].sum() / count
    assert out.token_count == plain.token_count == count
    torch.testing.assert_close(out.loss_sum / out.token_count, want, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out.loss_sum / out.token_count, (batch.logprobs, entropy))
    expected = torch.autograd.grad(want, (batch.logprobs, entropy))
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(a).all() and a[~counted].abs().sum() == 0
    metrics, plain_metrics = reduce_metrics([out]), reduce_metrics([plain])
    assert metrics["loss/kl"] == pytest.approx(kl.mean().item()) and "loss/kl" not in plain_metrics
    assert {k: v for k, v in metrics.items() if k != "loss/kl"} == plain_metrics  # loss/pg: the policy term alone


def test_entropy_bonus_gradient_raises_entropy():
    """The bonus's gradient with respect to each counted token's entropy is -entropy_coef / count: a
    descent step raises every counted token's entropy, and nothing else changes."""
    batch = _batch(6)
    entropy = batch.entropy.clone().requires_grad_()
    out = policy_loss(_with(batch, entropy=entropy), PolicyLossConfig(loss="ppo", entropy_coef=0.05))
    (grad,) = torch.autograd.grad(out.loss_sum / out.token_count, entropy)
    counted = batch.mask != 0
    torch.testing.assert_close(grad, torch.where(counted, -0.05 / counted.sum(), 0.0).to(grad))
    off = policy_loss(_with(batch, entropy=entropy), PolicyLossConfig(loss="ppo"))
    assert not off.loss_sum.requires_grad or torch.autograd.grad(off.loss_sum, entropy, allow_unused=True)[0] is None


def test_kl_and_entropy_settings_and_inputs_are_checked():
    from bapo_megatron.algo.losses import VERL_KL_TYPES, kl_estimate

    with pytest.raises(ValueError, match=r"kl_coef=0\.1 is set but PolicyBatch\.ref_logprobs is None"):
        policy_loss(_batch(0), PolicyLossConfig(loss="ppo", kl_coef=0.1))
    with pytest.raises(ValueError, match=r"entropy_coef=0\.1 is set but PolicyBatch\.entropy is None"):
        policy_loss(_with(_batch(0), entropy=None), PolicyLossConfig(loss="ppo", entropy_coef=0.1))
    with pytest.raises(ValueError, match=r"kl_coef=-0\.1: must be a finite number >= 0"):
        PolicyLossConfig(kl_coef=-0.1)
    with pytest.raises(ValueError, match=r"entropy_coef=inf"):
        PolicyLossConfig(entropy_coef=math.inf)
    with pytest.raises(ValueError, match=r"kl_type='k4': must be one of .* low_var_kl is k3"):
        PolicyLossConfig(kl_type="k4")
    d = torch.tensor([-3.0, 0.5, 25.0])  # verl's names are taken as they are
    for verl_name, ours in VERL_KL_TYPES.items():
        assert PolicyLossConfig(kl_type=verl_name).kl_type == verl_name
        torch.testing.assert_close(kl_estimate(d, torch.zeros(3), verl_name), kl_estimate(d, torch.zeros(3), ours))
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        _with(_batch(0), ref_logprobs=torch.zeros(1, 2))
    assert PolicyLossConfig().kl_coef == 0 and PolicyLossConfig().entropy_coef == 0  # off, as the authors ran
