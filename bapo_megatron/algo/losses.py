"""Policy losses: BAPO and the spec's baselines, one registry, one aggregation, one set of metrics.

Every loss returns a LossOutput whose loss_sum is sum_t m_t * w_t * loss_t over the tokens it
was given and whose token_count is sum_t m_t; the caller divides the step's summed loss by the
step's summed count (all micro-batches, all data-parallel ranks), a global token mean. The two
optional terms of any loss (kl_coef x a KL estimate to a reference policy, minus entropy_coef x
the entropy) are summed over the same tokens with the same m_t, so they are token means of the
step too (regularizers()).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import torch
import torch.distributed as dist

from bapo_megatron.algo import rollout_corr_metrics as corr_metrics
from bapo_megatron.algo.bapo import BAPOConfig, ClipBounds, contribution_sums, search_clip_bounds
from bapo_megatron.algo.metrics import LossOutput
from bapo_megatron.algo.rollout_correction import Corrected, RolloutCorrectionConfig, Sequences, apply_correction
from bapo_megatron.errors import ConfigError, check

LOG_RATIO_CLAMP = 20.0
"""r_t = exp(clamp(log pi - log mu, -20, 20)), as the spec defines it."""

LossName = Literal["bapo", "ppo", "clip_higher", "dual_clip", "gspo", "cispo", "sft"]
KLType = Literal["k1", "k2", "k3", "abs", "k1+", "k3+", "kl", "mse", "low_var_kl", "low_var_kl+"]
VERL_KL_TYPES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "abs": "abs", "k1+": "k1+", "low_var_kl+": "k3+"}
"""verl's actor.kl_loss_type names -> ours (verl also takes k1, k2, k3, k3+ as they are); kl_type
takes either."""
KL_CLAMP = 10.0
"""k3 is clamped to [-10, 10] (and its log-ratio to [-20, 20]) for numerical stability, as verl does."""


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """Which policy loss to use, and the parameters of each."""

    loss: LossName = "bapo"
    """One of POLICY_LOSSES: bapo, ppo, clip_higher, dual_clip, gspo, cispo; or sft, the supervised
    warm start (cross-entropy of the given responses; a run with it trains on data.path's answers)."""
    bapo: BAPOConfig = field(default_factory=BAPOConfig)
    """BAPO's bound search; its contribution measure also gives the baselines' bapo/rho metric."""
    ppo_eps: float = 0.2
    """ppo and dual_clip: fixed bounds (1 - eps, 1 + eps)."""
    clip_higher_low: float = 0.8
    """clip_higher (DAPO): the fixed lower bound."""
    clip_higher_high: float = 1.28
    """clip_higher (DAPO): the fixed upper bound."""
    dual_clip_c: float = 3.0
    """dual_clip: for A < 0 the per-token loss is capped at -c * A."""
    gspo_eps_low: float = 3e-4
    """gspo: the sequence ratio is clipped to [1 - eps_low, 1 + eps_high]."""
    gspo_eps_high: float = 4e-4
    """gspo: the upper side of that clip (1 + eps_high)."""
    cispo_eps_high: float = 0.28
    """cispo: the stop-gradient weight is clip(r, 0, 1 + eps_high)."""
    tis_cap: float | None = None
    """Truncated importance weight min(pi_prox / mu, cap) on any loss (None: off): the same as
    rollout_correction.rollout_is "token" with rollout_is_threshold cap."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights and rejection between the engine's policy and the trainer's, verl's
    algorithm.rollout_correction (docs/BAPO_SPEC.md, "Rollout correction")."""
    kl_coef: float = 0.0
    """A KL loss to the reference policy (the run's starting weights, held frozen by the trainer):
    the loss adds kl_coef x the token mean of a KL(pi || pi_ref) estimate, reported as loss/kl.
    0: off, no reference model is built (the BAPO authors ran without). verl: actor.use_kl_loss
    with actor.kl_loss_coef (verl's GRPO example uses 0.001)."""
    kl_type: KLType = "k3"
    """The per-token estimate of KL(pi || pi_ref) from d = log pi - log pi_ref of the sampled
    token (Schulman's estimators; verl's actor.kl_loss_type names in brackets): k1 = d ("kl");
    k2 = d^2 / 2 ("mse"); k3 = exp(-d) + d - 1, d clamped to [-20, 20] and the value to
    [-10, 10] ("low_var_kl", verl's default); abs = |d| ("abs"); k1+ and k3+: k1's or k3's value
    with k2's gradient, a straight-through estimator (verl's "k1+", "k3+"/"low_var_kl+"). verl's
    names are taken as they are."""
    entropy_coef: float = 0.0
    """An entropy bonus: the loss subtracts entropy_coef x the token mean of the policy's entropy
    (policy/entropy, at the sampling temperature). 0: off. verl: actor.entropy_coeff."""

    def __post_init__(self) -> None:
        check(self.loss in POLICY_LOSSES, "loss", self.loss, f"must be one of {sorted(POLICY_LOSSES)}")
        check(0.0 < self.ppo_eps < 1.0, "ppo_eps", self.ppo_eps, "must lie in (0, 1)")
        check(0.0 < self.clip_higher_low <= 1.0, "clip_higher_low", self.clip_higher_low, "must lie in (0, 1]")
        check(self.clip_higher_high >= 1.0, "clip_higher_high", self.clip_higher_high, "must be >= 1")
        check(
            math.isfinite(self.dual_clip_c) and self.dual_clip_c > 1.0,
            "dual_clip_c",
            self.dual_clip_c,
            "must be a finite number > 1",
        )
        check(0.0 < self.gspo_eps_low < 1.0, "gspo_eps_low", self.gspo_eps_low, "must lie in (0, 1)")
        check(self.gspo_eps_high > 0.0, "gspo_eps_high", self.gspo_eps_high, "must be > 0")
        check(self.cispo_eps_high > 0.0, "cispo_eps_high", self.cispo_eps_high, "must be > 0")
        if self.tis_cap is not None:
            check(
                math.isfinite(self.tis_cap) and self.tis_cap >= 1.0,
                "tis_cap",
                self.tis_cap,
                "must be None or a finite number >= 1",
            )
        corr, why = self.correction, "must be ppo with rollout_correction.loss_type reinforce"
        check(corr.loss_type == "ppo_clip" or self.loss == "ppo", "loss", self.loss, why)
        off = corr == RolloutCorrectionConfig()  # sft trains given answers, with no engine to correct for
        check(self.loss != "sft" or off, "rollout_correction", corr, "must stay off with loss sft")
        for name in ("kl_coef", "entropy_coef"):
            value = getattr(self, name)
            check(math.isfinite(value) and value >= 0.0, name, value, "must be a finite number >= 0 (0: off)")
        verl = ", ".join(f"{k} is {v}" for k, v in VERL_KL_TYPES.items() if k != v)
        known = self.kl_type in KL_ESTIMATES or self.kl_type in VERL_KL_TYPES
        check(known, "kl_type", self.kl_type, f"must be one of {list(KL_ESTIMATES)} ({verl})")

    @cached_property
    def correction(self) -> RolloutCorrectionConfig:
        """rollout_correction, with tis_cap read as the token-level truncated weight it is."""
        if self.tis_cap is None:
            return self.rollout_correction
        if self.rollout_correction.rollout_is is not None:
            raise ConfigError("tis_cap", self.tis_cap, "means rollout_correction.rollout_is=token: set one")
        return dataclasses.replace(self.rollout_correction, rollout_is="token", rollout_is_threshold=self.tis_cap)


@dataclass
class PolicyBatch:
    """Per-token inputs of a policy loss; every tensor has the same shape, e.g. [batch, seq]."""

    logprobs: torch.Tensor
    """log pi_theta of the sampled tokens (the trainer's forward pass, with gradient)."""
    old_logprobs: torch.Tensor
    """log mu: behaviour log-probs reported by the rollout engine, one per token."""
    advantages: torch.Tensor
    mask: torch.Tensor
    """1 for counted response tokens, 0 for prompt and padding (which may hold NaN)."""
    prox_logprobs: torch.Tensor | None = None
    """log pi_prox, recomputed at the start of the step; needed by a decoupled rollout correction
    (weights or rejection, tis_cap); the correction's metrics measure it where given."""
    ref_logprobs: torch.Tensor | None = None
    """log pi_ref of the reference policy (no gradient); needed only with kl_coef > 0."""
    entropy: torch.Tensor | None = None
    """Per-token entropy of pi_theta (with gradient for entropy_coef), reported as policy/entropy."""
    segment_ids: torch.Tensor | None = None
    """gspo: which response each token belongs to; default: each row of a 2-D batch is one."""
    top_logprobs: torch.Tensor | None = None
    """log pi_theta of each position's most likely token, from the same floats as logprobs, so
    logprobs == top_logprobs exactly where the given token is the greedy choice (sft reports
    sft/token_acc and sft/answer_acc from it)."""
    first_update: bool = True
    """The first update on a fresh rollout batch: the one whose weights are the ones that sampled
    (its own version's tokens), where the train-rollout log-prob gap is measured (rollout_corr_metrics)."""
    sequences: Sequences | None = None
    """Which response each token belongs to, for sequence-level correction and metrics; default:
    each row of a 2-D batch is one."""
    same_version: torch.Tensor | None = None
    """True where the step's own policy version sampled the token (splits the staleness metrics)."""
    is_scale: torch.Tensor | None = None
    """The step's mean importance weight, rollout_is_batch_normalize's divisor (the trainer's prepass)."""
    is_weight: torch.Tensor | None = None
    """The rollout correction's weight on each token's loss (policy_loss fills it; None: 1)."""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        names = ("old_logprobs", "advantages", "mask", "prox_logprobs", "ref_logprobs", "entropy", "segment_ids")
        for name in (*names, "top_logprobs", "same_version", "is_weight"):
            t = getattr(self, name)
            if t is not None and t.shape != shape:
                raise ValueError(f"PolicyBatch.{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")


# ----------------------------------------------------------------------------------------------
# Shared pieces.


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """r_t = exp(clamp(log pi - log mu, -20, 20))."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


@dataclass
class _Tokens:
    """Sanitised per-token tensors: masked-out positions hold neutral values, never NaN."""

    counted: torch.Tensor
    weight: torch.Tensor  # m_t (float)
    logprobs: torch.Tensor  # log pi with gradient, 0 where not counted
    log_ratio: torch.Tensor  # clamp(log pi - log mu, -20, 20), with gradient
    ratio: torch.Tensor  # exp(log_ratio), with gradient
    advantages: torch.Tensor
    is_weight: torch.Tensor  # the rollout correction's weight (detached), 1 when off


def _prepare(batch: PolicyBatch, cfg: PolicyLossConfig) -> _Tokens:
    counted = batch.mask != 0
    weight = torch.where(counted, batch.mask.to(batch.logprobs.dtype), 0.0)
    logprobs = torch.where(counted, batch.logprobs, 0.0)
    old = torch.where(counted, batch.old_logprobs.to(logprobs.dtype), 0.0)
    log_ratio = torch.clamp(logprobs - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # gspo needs it before exp
    advantages = torch.where(counted, batch.advantages.to(logprobs.dtype), 0.0)
    is_weight = torch.ones_like(weight) if batch.is_weight is None else batch.is_weight.to(weight).detach()
    return _Tokens(counted, weight, logprobs, log_ratio, torch.exp(log_ratio), advantages, is_weight)


def clipped_surrogate_loss(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    c_low: float,
    c_high: float,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """Per-token -v_t: -A min(r, c_high) for A > 0, -A max(r, c_low) for A < 0, 0 for A = 0.

    With dual_clip, the loss of A < 0 tokens is capped at -dual_clip * A.
    """
    positive = advantages * torch.clamp(ratio, max=c_high)
    negative = advantages * torch.clamp(ratio, min=c_low)
    if dual_clip is not None:
        negative = torch.maximum(negative, dual_clip * advantages)
    zero = torch.zeros_like(positive)
    return -torch.where(advantages > 0, positive, torch.where(advantages < 0, negative, zero))


def _output(
    tokens: _Tokens,
    per_token_loss: torch.Tensor,
    batch: PolicyBatch,
    cfg: PolicyLossConfig,
    c_low: float,
    c_high: float,
    dual_clip: float | None,
    bounds: ClipBounds | None = None,
) -> LossOutput:
    """Sum the loss and gather every metric of the spec for one set of (c_low, c_high)."""
    w = tokens.weight
    weighted = torch.where(tokens.counted, w * tokens.is_weight * per_token_loss, 0.0)
    count = w.sum()
    out = LossOutput(loss_sum=weighted.sum(), token_count=count.detach())
    r, a = tokens.ratio.detach(), tokens.advantages
    out.add_mean("loss/pg", weighted.detach().sum(), count)
    out.add_mean("policy/ratio_mean", (w * r).sum(), count)
    out.add_max("policy/ratio_max", torch.where(tokens.counted, r, 0.0).max() if r.numel() else r.new_zeros(()))
    out.add_mean("bapo/clipfrac_low", (w * ((a < 0) & (r < c_low))).sum(), count)
    out.add_mean("bapo/clipfrac_high", (w * ((a > 0) & (r > c_high))).sum(), count)
    if batch.entropy is not None:
        out.add_mean("policy/entropy", torch.where(tokens.counted, w * batch.entropy.detach(), 0.0).sum(), count)
    # The parts of two shares measured alike for every method (the paper's Fig. 4), as means over
    # the counted tokens, so that they add up over micro-batches, ranks and updates (a mini-batch
    # whose groups all carry no advantage adds 0 to each, where a ratio of its own would be 0/0):
    # the positive and negative parts of the loss at the bounds this step used, measured on the
    # loss whatever bapo.contribution says, and the tokens with A < 0 and with A != 0. The shares
    # are derived from them per step (train.update: policy/positive_loss_share,
    # policy/negative_token_share). Grids filled on the device (a tensor from host data would be
    # a blocking copy in every micro-batch).
    out.add_mean("policy/negative_tokens", (w * (a < 0)).sum(), count)
    out.add_mean("policy/signal_tokens", (w * (a != 0)).sum(), count)
    grid = (r.new_full((1,), c_low, dtype=torch.float64), r.new_full((1,), c_high, dtype=torch.float64))
    p, n, _ = contribution_sums(r, a, w * tokens.is_weight, *grid, "loss", dual_clip)
    out.add_mean("policy/positive_loss", p.sum(), count)
    out.add_mean("policy/negative_loss", n.sum(), count)
    if bounds is None:
        # Fixed bounds: report the positive share there, reduced as sum(P) / sum(P + N).
        if cfg.bapo.contribution != "loss":
            p, n, _ = contribution_sums(r, a, w * tokens.is_weight, *grid, cfg.bapo.contribution, dual_clip)
        for name in ("bapo/rho", "bapo/rho_start"):  # no search: the start is the end
            out.add_mean(name, p.sum(), (p + n).sum())
        bounds_metrics = {"bapo/clip_low": c_low, "bapo/clip_high": c_high, "bapo/search_steps": 0.0}
    else:
        bounds_metrics = bounds.metrics()
    one = r.new_ones((), dtype=torch.float64)
    for name, value in bounds_metrics.items():
        out.add_mean(name, r.new_full((), value, dtype=torch.float64), one)
    return out


# ----------------------------------------------------------------------------------------------
# The losses.


def bapo_loss(
    batch: PolicyBatch,
    cfg: PolicyLossConfig,
    bounds: ClipBounds | None = None,
    group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """BAPO: the clipped surrogate at adaptively chosen bounds.

    bounds: the step's bounds (bound_scope "step", searched by the caller over the whole step);
    None: search here over these tokens, summed over `group` (bound_scope "microbatch").
    """
    t = _prepare(batch, cfg)
    if bounds is None:
        bounds = search_clip_bounds(t.ratio.detach(), t.advantages, t.weight * t.is_weight, cfg.bapo, group)
    loss = clipped_surrogate_loss(t.ratio, t.advantages, bounds.c_low, bounds.c_high, cfg.bapo.dual_clip)
    return _output(t, loss, batch, cfg, bounds.c_low, bounds.c_high, cfg.bapo.dual_clip, bounds)


def _fixed_clip(c_low: float, c_high: float, dual: float | None, batch: PolicyBatch, cfg: PolicyLossConfig):
    t = _prepare(batch, cfg)
    loss = clipped_surrogate_loss(t.ratio, t.advantages, c_low, c_high, dual)
    return _output(t, loss, batch, cfg, c_low, c_high, dual)


def ppo_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """PPO: fixed bounds (1 - eps, 1 + eps)."""
    return _fixed_clip(1.0 - cfg.ppo_eps, 1.0 + cfg.ppo_eps, None, batch, cfg)


def clip_higher_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """DAPO's clip-higher: fixed asymmetric bounds (0.8, 1.28)."""
    return _fixed_clip(cfg.clip_higher_low, cfg.clip_higher_high, None, batch, cfg)


def dual_clip_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """PPO plus the dual clip: the loss of A < 0 tokens is capped at -c * A."""
    return _fixed_clip(1.0 - cfg.ppo_eps, 1.0 + cfg.ppo_eps, cfg.dual_clip_c, batch, cfg)


def _segment_mean(values: torch.Tensor, weight: torch.Tensor, segment_ids: torch.Tensor | None) -> torch.Tensor:
    """Per-token weighted mean of `values` over the token's segment (rows when segment_ids is None:
    the trainer's layout, computed without reading anything back to the host)."""
    tiny = torch.finfo(weight.dtype).tiny
    if segment_ids is None:
        if values.dim() != 2:
            raise ValueError(f"gspo needs a [batch, seq] layout or segment_ids; got shape {tuple(values.shape)}")
        means = (weight * values).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True).clamp(min=tiny)
        return means.expand_as(values)
    _, inverse = torch.unique(segment_ids.reshape(-1), return_inverse=True)
    sums = values.new_zeros(int(inverse.max()) + 1 if inverse.numel() else 0)
    counts = torch.zeros_like(sums)
    sums = sums.index_add(0, inverse, (weight * values).reshape(-1))
    counts = counts.index_add(0, inverse, weight.reshape(-1))
    means = sums / counts.clamp(min=tiny)
    return means[inverse].reshape(values.shape)


def gspo_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """GSPO: every token of a response takes the sequence ratio exp(mean_t log r_t), clipped tightly.

    Under the global token mean each token carries gradient s_i * A_i * grad log pi_t, the
    same as GSPO's sequence objective weighted by response length.
    """
    t = _prepare(batch, cfg)
    seq_log_ratio = _segment_mean(t.log_ratio, t.weight, batch.segment_ids)
    t.ratio = torch.exp(torch.clamp(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    c_low, c_high = 1.0 - cfg.gspo_eps_low, 1.0 + cfg.gspo_eps_high
    loss = clipped_surrogate_loss(t.ratio, t.advantages, c_low, c_high)
    return _output(t, loss, batch, cfg, c_low, c_high, None)


def cispo_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """CISPO: -sg(clip(r, 0, 1 + eps_high)) * A * log pi; every token keeps its gradient."""
    t = _prepare(batch, cfg)
    c_high = 1.0 + cfg.cispo_eps_high
    is_ratio = torch.clamp(t.ratio, max=c_high).detach()
    loss = -is_ratio * t.advantages * t.logprobs
    return _output(t, loss, batch, cfg, 0.0, c_high, None)


def sft_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """Supervised fine-tuning: -log pi of every counted token of the given responses (no ratio,
    no advantage), summed like the policy losses, so the step divides it by the token count."""
    counted = batch.mask != 0
    w = torch.where(counted, batch.mask.to(batch.logprobs.dtype), 0.0)
    nll = torch.where(counted, -w * torch.where(counted, batch.logprobs, 0.0), 0.0)
    count = w.sum()
    out = LossOutput(loss_sum=nll.sum(), token_count=count.detach())
    out.add_mean("loss/sft", nll.detach().sum(), count)
    if batch.entropy is not None:
        out.add_mean("policy/entropy", torch.where(counted, w * batch.entropy.detach(), 0.0).sum(), count)
    if batch.top_logprobs is not None:
        # Teacher-forced argmax accuracy. A response whose every token is the argmax given the
        # true prefix is exactly what greedy decoding answers: answer_acc is the batch's greedy
        # exact-match accuracy (each row of a [batch, seq] layout is one response).
        greedy = batch.logprobs.detach() == batch.top_logprobs
        out.add_mean("sft/token_acc", (w * greedy).sum(), count)
        if batch.logprobs.dim() == 2:
            answered = counted.any(-1)
            right = answered & (greedy | ~counted).all(-1)
            out.add_mean("sft/answer_acc", right.sum().to(w.dtype), answered.sum().to(w.dtype))
    return out


# ----------------------------------------------------------------------------------------------
# Terms any loss can carry: a KL loss to a reference policy, an entropy bonus.


def _k3(d: torch.Tensor) -> torch.Tensor:
    log_ratio = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # log pi_ref / pi
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -KL_CLAMP, KL_CLAMP)


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _straight_through(value: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`value`'s estimate with k2's gradient, d x grad log pi: on tokens sampled from pi, an unbiased
    estimate of the gradient of KL(pi || pi_ref), which k1's and k3's own gradients are not."""

    def estimate(d: torch.Tensor) -> torch.Tensor:
        k2 = _k2(d)
        return k2 - k2.detach() + value(d).detach()

    return estimate


KL_ESTIMATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda d: d,
    "k2": _k2,
    "k3": _k3,
    "abs": torch.abs,
    "k1+": _straight_through(lambda d: d),
    "k3+": _straight_through(_k3),
}
"""kl_type -> the per-token estimate of KL(pi || pi_ref) as a function of d = log pi - log pi_ref."""


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) at the sampled tokens (PolicyLossConfig.kl_type)."""
    return KL_ESTIMATES[VERL_KL_TYPES.get(kl_type, kl_type)](logprobs - ref_logprobs)


def regularizers(batch: PolicyBatch, cfg: PolicyLossConfig) -> tuple[torch.Tensor, dict[str, tuple]]:
    """(kl_coef x sum_t m_t KL_t - entropy_coef x sum_t m_t H_t, their metrics as (sum, count)).

    Summed with the m_t of the policy term and over the same tokens, so that the step's division
    by its token count makes each a token mean (verl's kl_loss and entropy_loss under token-mean
    aggregation); neither is weighted by tis_cap's importance weight (verl's are not). Zero, with
    no metric, for a coefficient of 0."""
    counted = batch.mask != 0
    w = torch.where(counted, batch.mask.to(batch.logprobs.dtype), 0.0)
    total, metrics = w.new_zeros(()), {}
    if cfg.kl_coef > 0:
        if batch.ref_logprobs is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} is set but PolicyBatch.ref_logprobs is None")
        logprobs = torch.where(counted, batch.logprobs, 0.0)
        ref = torch.where(counted, batch.ref_logprobs.to(logprobs.dtype), 0.0)
        kl = (w * kl_estimate(logprobs, ref, cfg.kl_type)).sum()
        total = total + cfg.kl_coef * kl
        metrics["loss/kl"] = (kl, w.sum())
    if cfg.entropy_coef > 0:
        if batch.entropy is None:
            raise ValueError(f"entropy_coef={cfg.entropy_coef} is set but PolicyBatch.entropy is None")
        entropy = torch.where(counted, w * batch.entropy.to(w.dtype), 0.0).sum()
        total = total - cfg.entropy_coef * entropy
    return total, metrics


PolicyLossFn = Callable[..., LossOutput]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "bapo": bapo_loss,
    "ppo": ppo_loss,
    "clip_higher": clip_higher_loss,
    "dual_clip": dual_clip_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "sft": sft_loss,
}


def reinforce_loss(batch: PolicyBatch, cfg: PolicyLossConfig, bounds=None, group=None) -> LossOutput:
    """verl's bypass REINFORCE (loss_type reinforce): -w_t A_t log pi_t; no clip (bounds 0, e^20)."""
    t = _prepare(batch, cfg)
    return _output(t, -t.advantages * t.logprobs, batch, cfg, 0.0, math.exp(LOG_RATIO_CLAMP), None)


def corrected(batch: PolicyBatch, cfg: PolicyLossConfig) -> tuple[PolicyBatch, Corrected]:
    """The batch the loss trains on (rejected tokens out of its mask, the correction's weight on
    each token's loss: docs/BAPO_SPEC.md) and the correction that made it."""
    seqs = batch.sequences or Sequences.of(batch.logprobs, batch.segment_ids)
    prox, old = batch.prox_logprobs, batch.old_logprobs
    fixed = apply_correction(batch.logprobs, prox, old, batch.mask, seqs, cfg.correction, batch.is_scale)
    return dataclasses.replace(batch, mask=fixed.mask, is_weight=fixed.is_weight), fixed


def policy_loss(
    batch: PolicyBatch,
    cfg: PolicyLossConfig,
    bounds: ClipBounds | None = None,
    group: dist.ProcessGroup | None = None,
) -> LossOutput:
    """The configured loss on the rollout-corrected batch with its KL and entropy terms
    (regularizers) and the rollout_corr/ metrics; `bounds` and `group` matter to bapo only."""
    train, fixed = (batch, None) if cfg.loss == "sft" else corrected(batch, cfg)
    loss = reinforce_loss if cfg.correction.loss_type == "reinforce" else POLICY_LOSSES[cfg.loss]
    out = loss(train, cfg, bounds=bounds, group=group)
    extra, metrics = regularizers(train, cfg)
    if cfg.kl_coef > 0 or cfg.entropy_coef > 0:
        out.loss_sum = out.loss_sum + extra
    for name, (value, count) in metrics.items():
        out.add_mean(name, value, count)
    if fixed is not None:
        corr_metrics.add_metrics(
            out, fixed, batch.old_logprobs, batch.mask, batch.same_version, batch.is_scale, batch.first_update
        )
    return out
