"""Rollout correction: importance weights, rejection and the off-policy metrics between the engine and the trainer.

verl 0.9.1's `algorithm.rollout_correction` (rollout_corr_helper.py), with its key names and its
metric names, as pure tensor functions over one micro-batch (its metrics: rollout_corr_metrics.py).
Every statistic is a log-ratio l_t = log pi_t - log mu_t of the sampled token, pi the trainer's
policy that the correction measures (pi_prox in decoupled mode, the current policy in bypass mode)
and mu the engine's. Sequences are given by a per-token index (Sequences), so padded rows and
packed rows read alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import torch

from bapo_megatron.errors import ConfigError, check

SAFETY_BOUND = 20.0
"""Log-ratios are clamped to [-20, 20] before exp, as verl does."""
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
"""verl's rollout_rs statistics: k1 = -l, k2 = l^2 / 2, k3 = exp(l) - 1 - l, per token or per sequence."""
EPS = 1e-8
"""verl's masked mean divides by count + 1e-8."""


def parse_is_threshold(spec: float | str) -> tuple[float | None, float]:
    """(lower, upper) of verl's rollout_is_threshold: a number is an upper bound (truncate), a
    "lower_upper" string both (mask outside them, IcePop)."""
    field = "rollout_is_threshold"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ConfigError(field, spec, "must be a number or a 'lower_upper' string")
    lower: float | None = None
    try:
        if isinstance(spec, str) and "_" in spec:
            low, high = spec.strip().split("_", 1)
            lower, upper = float(low), float(high)
        else:
            upper = float(spec)
    except ValueError:
        raise ConfigError(field, spec, "must be a number or a 'lower_upper' string, e.g. 0.5_2.0") from None
    check(math.isfinite(upper) and upper > 0, field, spec, "the upper bound must be a finite number > 0")
    if lower is not None:
        check(0 < lower <= upper, field, spec, "the lower bound must lie in (0, upper]")
    return lower, upper


@dataclass(frozen=True)
class RejectionRule:
    """One rollout_rs option and its bounds: ratio bounds for k1 (kept where -l lies in
    [log lower, log upper], verl's reading), an upper bound on the divergence otherwise."""

    option: str
    lower: float | None
    upper: float

    @property
    def k1(self) -> bool:
        return self.option.endswith("k1")

    @property
    def level(self) -> str:
        return "token" if self.option.startswith("token") else "sequence"

    def metric_bounds(self) -> tuple[float, float]:
        """(lower, upper) in the statistic's units (k1: logs; others: 0 and the bound)."""
        if self.k1:
            return math.log(self.lower), math.log(self.upper)
        return 0.0, self.upper


def parse_rs(options: str, spec: float | str | None) -> tuple[RejectionRule, ...]:
    """verl's rollout_rs ("token_k1,seq_mean_k3") and rollout_rs_threshold (one entry, or one per option)."""
    field = "rollout_rs"
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    check(bool(names), field, options, f"must name one or more of {list(RS_OPTIONS)}")
    for name in names:
        check(name in RS_OPTIONS, field, options, f"{name!r} is not one of {list(RS_OPTIONS)}")
    field = "rollout_rs_threshold"
    check(spec is not None, field, spec, "must be set when rollout_rs is")
    check(not isinstance(spec, bool), field, spec, "must be a number or a string")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()] if isinstance(spec, str) else [str(spec)]
    check(len(parts) in (1, len(names)), field, spec, f"needs one entry or one per option ({len(names)})")
    rules = []
    for name, part in zip(names, parts * len(names) if len(parts) == 1 else parts, strict=False):
        try:
            low, _, high = part.rpartition("_") if "_" in part else ("", "", part)
            upper = float(high)
            lower = float(low) if low else (1.0 / upper if name.endswith("k1") else None)
        except (ValueError, ZeroDivisionError):
            raise ConfigError(field, spec, f"{part!r} is not a number (or lower_upper) for {name}") from None
        check(low == "" or name.endswith("k1"), field, spec, f"{name} takes an upper bound only, not {part!r}")
        check(math.isfinite(upper) and upper > 0, field, spec, f"the bound of {name} must be > 0")
        check(lower is None or 0 < lower <= upper, field, spec, f"{name} needs 0 < lower <= upper")
        rules.append(RejectionRule(name, lower, upper))
    return tuple(rules)


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """algo.rollout_correction: verl's algorithm.rollout_correction, its keys as they are."""

    rollout_is: Literal["token", "sequence", "geometric"] | None = None
    """The importance weight's level (None: no weight, the metrics only): "token" w_t = exp(l_t);
    "sequence" exp(sum_t l_t) on every token of the response; "geometric" exp(mean_t l_t) (an
    addition to verl 0.9.1's two, its seq_mean_k1 as a weight)."""
    rollout_is_threshold: float | str = 2.0
    """A number: the weight is truncated there (TIS); "lower_upper" (e.g. "0.5_2.0"): weights
    outside [lower, upper] are set to 0 (masked, IcePop); the token still counts in the mean."""
    rollout_is_batch_normalize: bool = False
    """Divide the weights by their mean over the step (tokens, or sequences at sequence level)."""
    rollout_rs: str | None = None
    """Rejection: comma-separated statistics of RS_OPTIONS; a token (or every token of a
    sequence) outside any bound leaves the loss, the bound search and the step's token count."""
    rollout_rs_threshold: float | str | None = None
    """One entry, or one per rollout_rs option: k1 takes "lower_upper" ratio bounds (a number x:
    1/x_x); k2 and k3 an upper bound."""
    bypass_mode: bool = False
    """True: the engine's log-probs are the old policy, the statistics come from the current
    policy in the loss and nothing is recomputed for them; False (decoupled): from pi_prox, the
    forward-only pass at the start of the step."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """In bypass mode: "ppo_clip" keeps algo.loss, whose ratio pi / mu already is the weight (the
    weights are measured, not applied); "reinforce": -w_t A_t log pi_t, with algo.loss ppo."""

    def __post_init__(self) -> None:
        _ = self.is_bounds, self.rules  # validated now, once
        if self.loss_type == "reinforce":
            check(self.bypass_mode, "loss_type", self.loss_type, "is read in bypass mode only")
        if self.bypass_mode:
            check(
                not self.rollout_is_batch_normalize,
                "rollout_is_batch_normalize",
                True,
                "needs the step's weights before the loss: decoupled mode only (bypass_mode: false)",
            )

    @cached_property
    def is_bounds(self) -> tuple[float | None, float]:
        return parse_is_threshold(self.rollout_is_threshold)

    @cached_property
    def rules(self) -> tuple[RejectionRule, ...]:
        return () if self.rollout_rs is None else parse_rs(self.rollout_rs, self.rollout_rs_threshold)

    @property
    def weighs(self) -> bool:
        """The loss is multiplied by the weights (measured only in bypass ppo_clip)."""
        return self.rollout_is is not None and not (self.bypass_mode and self.loss_type == "ppo_clip")

    @property
    def needs_prox(self) -> bool:
        """The correction reads pi_prox, the start-of-step forward-only pass."""
        return not self.bypass_mode and (self.rollout_is is not None or bool(self.rules))


# ----------------------------------------------------------------------------------------------
# Sequences and weights.


@dataclass
class Sequences:
    """Which sequence each token belongs to: ids in [0, count) (`count` on the host), or count for
    a token of none (padding rows, a packed row's tail)."""

    ids: torch.Tensor
    count: int

    @staticmethod
    def rows(shape: torch.Size, count: int, device: torch.device) -> Sequences:
        """Row i of a [rows, seq] batch is sequence i, for the first `count` rows."""
        row = torch.arange(shape[0], device=device).clamp(max=count).unsqueeze(-1)
        return Sequences(row.expand(shape), count)

    @staticmethod
    def packed(cu_seqlens: torch.Tensor, count: int, length: int) -> Sequences:
        """One packed row: its first `count` segments (cu_seqlens' boundaries) are sequences."""
        pos = torch.arange(length, device=cu_seqlens.device)
        seg = torch.bucketize(pos, cu_seqlens[1:].to(pos), right=True).clamp(max=count)
        return Sequences(seg.unsqueeze(0), count)

    @staticmethod
    def of(logprobs: torch.Tensor, segment_ids: torch.Tensor | None = None) -> Sequences:
        """Rows of a 2-D batch; else the sequences `segment_ids` name (one sequence without them)."""
        shape, device = logprobs.shape, logprobs.device
        if logprobs.dim() == 2 and segment_ids is None:
            return Sequences.rows(shape, shape[0], device)
        if segment_ids is None:
            return Sequences(torch.zeros(shape, dtype=torch.long, device=device), 1)
        _, inverse = torch.unique(segment_ids, return_inverse=True)
        return Sequences(inverse, int(inverse.max()) + 1 if inverse.numel() else 0)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """[count] per-sequence sums of `values` (zero where a token is not counted)."""
        out = values.new_zeros(self.count + 1).index_add(0, self.ids.reshape(-1), values.reshape(-1))
        return out[: self.count]

    def spread(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """A per-sequence value on each of the sequence's tokens."""
        return torch.cat([per_sequence, per_sequence.new_zeros(1)])[self.ids]


@dataclass
class Rejection:
    """One rejection rule's statistic (per token; per sequence, or None) and its keep (1.0 / 0.0)."""

    rule: RejectionRule
    stat: torch.Tensor
    per_seq: torch.Tensor | None
    keep: torch.Tensor


@dataclass
class Correction:
    """One micro-batch's correction: what the loss multiplies and keeps, and what it measured."""

    weight: torch.Tensor
    """w_t (detached; 1 where no weight is applied), before batch normalisation."""
    keep: torch.Tensor
    """1.0 where the token trains, 0.0 where rejection removed it."""
    raw: torch.Tensor | None
    """exp(l) at the level, before truncation or masking (None: no weight configured)."""
    seq_log: torch.Tensor | None
    """Per-sequence log weight (sequence and geometric levels)."""
    rejections: list[Rejection]


def seq_means(values: torch.Tensor, m: torch.Tensor, seqs: Sequences) -> torch.Tensor:
    """[count] masked means per sequence, verl's masked_mean (0 for a sequence of no tokens)."""
    return seqs.sum(values * m) / (seqs.sum(m) + EPS)


def log_ratio(logprobs: torch.Tensor, old: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """l_t = log pi_t - log mu_t where counted, 0 elsewhere (padding may hold NaN)."""
    return torch.where(m > 0, logprobs.detach() - old, 0.0)


def importance_weights(lr: torch.Tensor, m: torch.Tensor, seqs: Sequences, cfg: RolloutCorrectionConfig):
    """(raw weights exp(l) at the level, zero where not counted; per-sequence log weight or None)."""
    seq_log = None
    if cfg.rollout_is == "token":
        raw = torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        seq_log = seqs.sum(lr * m)
        if cfg.rollout_is == "geometric":
            seq_log = seq_log / seqs.sum(m).clamp(min=1.0)
        raw = seqs.spread(torch.exp(seq_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)))
    return raw * m, seq_log


def bounded(raw: torch.Tensor, bounds: tuple[float | None, float]) -> torch.Tensor:
    """Truncate at the upper bound, or with a lower bound too zero what lies outside both."""
    lower, upper = bounds
    if lower is None:
        return raw.clamp(max=upper)
    return torch.where((raw >= lower) & (raw <= upper), raw, 0.0)


def rs_statistic(rule: RejectionRule, lr: torch.Tensor, m: torch.Tensor, seqs: Sequences):
    """(per-token statistic, per-sequence statistic or None) of one rejection rule."""
    safe = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k = {"k1": -safe, "k2": 0.5 * safe.square(), "k3": torch.exp(safe) - 1.0 - safe}[rule.option[-2:]]
    if rule.level == "token":
        return k, None
    if rule.option.startswith("seq_sum"):
        per_seq = seqs.sum(k * m)
    elif rule.option.startswith("seq_mean"):
        per_seq = seq_means(k, m, seqs)
    else:  # seq_max: verl gives a sequence of no tokens 0
        floor = torch.where(m > 0, k, -math.inf)
        per_seq = k.new_full((seqs.count + 1,), -math.inf).scatter_reduce(
            0, seqs.ids.reshape(-1), floor.reshape(-1), "amax"
        )[: seqs.count]
        per_seq = torch.where(per_seq == -math.inf, 0.0, per_seq)
    return seqs.spread(per_seq), per_seq


def keeps(rule: RejectionRule, stat: torch.Tensor) -> torch.Tensor:
    lower, upper = rule.metric_bounds()
    return (stat >= lower) & (stat <= upper) if rule.k1 else stat <= upper


def correct(logprobs: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, seqs: Sequences, cfg) -> Correction:
    """The micro-batch's Correction from log pi (the policy the correction measures) and log mu."""
    m = (mask != 0).to(torch.float64)
    lr = log_ratio(logprobs, old, mask).to(torch.float64)
    keep, rejections = torch.ones_like(m), []
    for rule in cfg.rules:
        stat, per_seq = rs_statistic(rule, lr, m, seqs)
        option_keep = keeps(rule, stat).to(m)
        rejections.append(Rejection(rule, stat, per_seq, option_keep))
        keep = keep * option_keep
    weight, raw, seq_log = torch.ones_like(m), None, None
    if cfg.rollout_is is not None:
        raw, seq_log = importance_weights(lr, m, seqs, cfg)
        weight = bounded(raw, cfg.is_bounds)
    return Correction(weight.to(logprobs.dtype), keep.to(logprobs.dtype), raw, seq_log, rejections)


def batch_mean_parts(c: Correction, mask: torch.Tensor, seqs: Sequences, level: str) -> torch.Tensor:
    """[2] (sum, count) of the weights' mean that batch normalisation divides by: over tokens, or
    over sequences of their token means at sequence level (verl's)."""
    m = (mask != 0).to(torch.float64)
    w = c.weight.to(torch.float64)
    if level == "token":
        return torch.stack([(w * m).sum(), m.sum()])
    valid = (seqs.sum(m) > 0).to(m)
    return torch.stack([(seq_means(w, m, seqs) * valid).sum(), valid.sum()])


def normaliser(parts: torch.Tensor) -> torch.Tensor:
    """The step's mean weight from its summed (sum, count), 1 where it is ~0 (verl's guard), on the device."""
    mean = parts[0] / parts[1].clamp(min=EPS)
    return torch.where(mean > EPS, mean, torch.ones_like(mean))


@dataclass
class Corrected:
    """What the loss trains on after the correction, and what the metrics read of it."""

    mask: torch.Tensor
    """The mask with rejected tokens out."""
    is_weight: torch.Tensor | None
    """The weight on each token's loss (batch-normalised where configured); None: 1."""
    correction: Correction
    measured: torch.Tensor
    """The log-probs the correction measured (pi_prox in decoupled mode, else log pi, detached)."""
    sequences: Sequences
    cfg: RolloutCorrectionConfig


def apply_correction(logprobs, prox_logprobs, old, mask, seqs: Sequences, cfg, is_scale=None) -> Corrected:
    """The correction of one micro-batch: `is_scale` is the step's mean weight (batch normalisation)."""
    if cfg.needs_prox and prox_logprobs is None:
        raise ValueError("a decoupled rollout correction (or tis_cap) needs prox_logprobs, the start-of-step pi_prox")
    measured = prox_logprobs if not cfg.bypass_mode and prox_logprobs is not None else logprobs.detach()
    c = correct(measured, old, mask, seqs, cfg)
    weight = c.weight if cfg.weighs else None
    if weight is not None and cfg.rollout_is_batch_normalize:
        if is_scale is None:
            raise ValueError("rollout_is_batch_normalize needs the step's mean weight (the trainer's prepass)")
        weight = weight / is_scale.to(weight)
    kept = mask * c.keep.to(mask.dtype) if cfg.rules else mask
    return Corrected(kept, weight, c, measured, seqs, cfg)
