"""The rollout_corr/ metrics of a step, verl 0.9.1's names and values, as sums that reduce once.

Each function adds one micro-batch's parts to a LossOutput: token means and sequence means as
(sum, count), maxima and minima, and for what is not a mean (a standard deviation, the effective
sample size) hidden parts that finish() turns into the metric after the step's one reduction, so
that micro-batches and data-parallel ranks add up to verl's value over the whole batch. Sequence
means count every sequence given, an empty response too (verl's rows); a micro-batch of no counted
token adds nothing to a token mean.
"""

from __future__ import annotations

import math

import torch

from bapo_megatron.algo.metrics import LossOutput
from bapo_megatron.algo.rollout_correction import (
    EPS,
    SAFETY_BOUND,
    Corrected,
    Correction,
    Rejection,
    RolloutCorrectionConfig,
    Sequences,
)

PREFIX = "rollout_corr/"
HIDDEN = PREFIX + "_"
"""Parts of derived metrics: reduced with the rest, replaced by their metric in finish()."""
ABS_DIFF = PREFIX + "train_rollout_logprob_abs_diff"
"""Miles' and slime's train-rollout log-prob gap, the mean |log pi - log mu|; ABS_DIFF +
"_same_version" is the train-inference mismatch proper (the gate logging.checks bounds)."""
MISMATCH_METRICS = (ABS_DIFF, ABS_DIFF + "_same_version", ABS_DIFF + "_older", PREFIX + "log_ppl_abs_diff")
"""The absolute train-rollout log-prob differences a step reports (a bound in log-prob units fits them)."""


class _Adder:
    """Adds one micro-batch's metric parts under PREFIX: token means over m, sequence means over
    the sequences given (`over`: a [count] 0/1 selection of them). What several metrics share (the
    counted tokens, each sequence's token count, each selection's count) is computed once: on a
    CPU step of the demo's size the metrics' cost is the number of tensor operations."""

    def __init__(self, out: LossOutput, m: torch.Tensor, seqs: Sequences) -> None:
        self.out, self.m, self.seqs = out, m, seqs
        self.counted = m > 0
        self.n_tok = m.sum()
        self.seq_tokens = seqs.sum(m)
        """Each sequence's counted tokens."""
        self._selections: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def seq_means(self, values: torch.Tensor) -> torch.Tensor:
        """rollout_correction.seq_means(values, m, seqs), the token counts summed once."""
        return self.seqs.sum(values * self.m) / (self.seq_tokens + EPS)

    def _selection(self, over: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(over > 0, over.sum()), once per selection tensor (the same few are passed many times)."""
        held = self._selections.get(id(over))
        if held is None or held[0] is not over:
            held = self._selections[id(over)] = (over, over > 0, over.sum())
        return held[1], held[2]

    def token_mean(self, name: str, values: torch.Tensor) -> None:
        self.out.add_mean(PREFIX + name, torch.where(self.counted, values, 0.0).sum(), self.n_tok)

    def seq_mean(self, name: str, values: torch.Tensor, over: torch.Tensor | None = None) -> None:
        if over is None:
            self.out.add_mean(PREFIX + name, values.sum(), values.new_full((), values.numel()))
        else:
            self.out.add_mean(PREFIX + name, (values * over).sum(), self._selection(over)[1])

    def extremes(self, name: str, values: torch.Tensor, over: torch.Tensor, which=("max", "min")) -> None:
        """Maximum and minimum of `values` where `over` (neutral where nothing is)."""
        if values.numel() == 0:
            return
        where = self.counted if over is self.m else self._selection(over)[0]
        if "max" in which:
            self.out.add_max(PREFIX + name + "_max", torch.where(where, values, -math.inf).max())
        if "min" in which:
            self.out.add_min(PREFIX + name + "_min", torch.where(where, values, math.inf).min())

    def deviation(self, name: str, values: torch.Tensor, over: torch.Tensor) -> None:
        if values.numel():
            self.out.add_max(PREFIX + name, torch.where(self._selection(over)[0], values, -math.inf).max())

    def std_parts(self, name: str, values: torch.Tensor) -> None:
        """A token std: its two moments, finished as sqrt(E[x^2] - E[x]^2)."""
        self.token_mean(f"_{name}:m1", values)
        self.token_mean(f"_{name}:m2", values.square())

    def seq_std_parts(self, name: str, values: torch.Tensor, over: torch.Tensor) -> None:
        """An unbiased std over sequences (torch.std): count, sum, sum of squares."""
        for part, x in (("n", over), ("s", values * over), ("ss", values.square() * over)):
            self.out.add_sum(f"{HIDDEN}{name}:{part}", x.sum())


def offpolicy_metrics(out: LossOutput, logprobs, old, mask, seqs: Sequences) -> None:
    """verl's compute_offpolicy_metrics: log pi (the policy measured) against log mu."""
    m = (mask != 0).to(torch.float64)
    lp = torch.where(m > 0, logprobs.detach().to(m), 0.0)
    mu = torch.where(m > 0, old.to(m), 0.0)
    add = _Adder(out, m, seqs)
    train, roll = add.seq_means(lp), add.seq_means(mu)
    add.seq_mean("training_ppl", torch.exp(-train))
    add.seq_mean("training_log_ppl", -train)
    add.token_mean("kl", mu - lp)
    lr = lp - mu
    add.token_mean("k3_kl", torch.exp(lr) - lr - 1.0)
    add.seq_mean("rollout_ppl", torch.exp(-roll))
    add.seq_mean("rollout_log_ppl", -roll)
    diff = roll - train
    add.seq_mean("log_ppl_diff", diff)
    add.seq_mean("log_ppl_abs_diff", diff.abs())
    add.extremes("log_ppl_diff", diff, torch.ones_like(diff))
    add.seq_mean("ppl_ratio", torch.exp(diff))
    add.token_mean("chi2_token", torch.exp(lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)).square() - 1.0)
    log_seq = seqs.sum(lr * m).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    add.seq_mean("chi2_seq", torch.exp(2.0 * log_seq) - 1.0)


def is_metrics(out: LossOutput, c: Correction, mask, seqs: Sequences, cfg: RolloutCorrectionConfig) -> None:
    """verl's compute_is_metrics (and rollout_is_oob_ratio under IcePop bounds), on the weights
    before batch normalisation."""
    lower, upper = cfg.is_bounds
    low = 1.0 / upper if lower is None else lower
    m = (mask != 0).to(torch.float64)
    w, raw = c.weight.to(m), c.raw.to(m)
    add, every = _Adder(out, m, seqs), m.new_ones(seqs.count)
    add.token_mean("rollout_is_mean", w)
    if c.seq_log is None:
        add.token_mean("rollout_is_ratio_fraction_high", (raw > upper).to(m))
        add.token_mean("rollout_is_ratio_fraction_low", (raw < low).to(m))
        add.extremes("rollout_is", w, m)
    else:  # sequence and geometric levels: from the per-sequence log weight, unclamped
        log = c.seq_log.to(m)
        add.seq_mean("rollout_is_ratio_fraction_high", (log > math.log(upper)).to(m))
        add.seq_mean("rollout_is_ratio_fraction_low", (log < math.log(low)).to(m))
        add.extremes("rollout_is", torch.exp(log.clamp(max=SAFETY_BOUND)), every, which=("max",))
        add.extremes("rollout_is", torch.exp(log), every, which=("min",))
    add.std_parts("rollout_is", w.clamp(0.0, upper))
    seq_w = add.seq_means(w)
    add.seq_mean("rollout_is_seq_mean", seq_w)
    add.seq_std_parts("rollout_is_seq_std", seq_w, every)
    add.extremes("rollout_is_seq", seq_w, every)
    add.deviation("rollout_is_seq_max_deviation", (seq_w - 1.0).abs(), every)
    raw_seq = add.seq_means(raw)
    add.seq_mean("rollout_is_seq_fraction_high", (raw_seq > upper).to(m))
    add.seq_mean("rollout_is_seq_fraction_low", (raw_seq < low).to(m))
    if lower is not None:
        add.token_mean("rollout_is_oob_ratio", ((raw < lower) | (raw > upper)).to(m))


def rs_metrics(out: LossOutput, rejections: list[Rejection], mask, seqs: Sequences) -> None:
    """verl's compute_rs_metrics for each rule, its masked fractions, and the overall ones."""
    m = (mask != 0).to(torch.float64)
    add = _Adder(out, m, seqs)
    valid = (add.seq_tokens > 0).to(m)
    keep = torch.ones_like(m)
    for rej in rejections:
        _rule_metrics(add, rej, m, seqs, valid)
        keep = keep * rej.keep.to(m)
    if rejections:
        dropped = (1.0 - keep) * m
        add.token_mean("rollout_rs_masked_fraction", 1.0 - keep)
        add.seq_mean("rollout_rs_seq_masked_fraction", (seqs.sum(dropped) > 0).to(m))


def _rule_metrics(add: _Adder, rej: Rejection, m, seqs: Sequences, valid: torch.Tensor) -> None:
    rule, stat = rej.rule, rej.stat.to(m)
    name = f"rollout_rs_{rule.option}"
    lower, upper = rule.metric_bounds()
    seq_values = (add.seq_means(stat) if rej.per_seq is None else rej.per_seq).to(m)
    add.token_mean(f"{name}_mean", stat)
    if rule.level == "sequence":
        add.extremes(name, seq_values, valid)
        add.seq_mean(f"{name}_fraction_high", (seq_values > upper).to(m), valid)
        add.seq_mean(f"{name}_fraction_low", (seq_values < lower).to(m) * rule.k1, valid)
    else:
        add.extremes(name, stat, m)
        add.token_mean(f"{name}_fraction_high", (stat > upper).to(m))
        add.token_mean(f"{name}_fraction_low", (stat < lower).to(m) * rule.k1)
    add.std_parts(name, stat.clamp(lower if rule.k1 else 0.0, upper))
    add.seq_mean(f"{name}_seq_mean", seq_values, valid)
    add.seq_std_parts(f"{name}_seq_std", seq_values, valid)
    add.extremes(f"{name}_seq", seq_values, valid)
    add.deviation(f"{name}_seq_max_deviation", seq_values.abs(), valid)
    add.seq_mean(f"{name}_seq_fraction_high", (seq_values > upper).to(m), valid)
    if rule.k1:
        add.seq_mean(f"{name}_seq_fraction_low", (seq_values < lower).to(m), valid)
    option_keep = rej.keep.to(m)
    add.token_mean(f"{name}_masked_fraction", 1.0 - option_keep)
    add.seq_mean(f"{name}_seq_masked_fraction", (seqs.sum((1.0 - option_keep) * m) > 0).to(m), valid)


def staleness_metrics(out: LossOutput, logprobs, old, mask, same: torch.Tensor | None) -> None:
    """NeMo-RL's token_mult_prob_error (the token mean of exp|log pi - log mu|) and the mean
    |log pi - log mu| (Miles' and slime's train_rollout_logprob_abs_diff), over every counted
    token and, with `same` (tokens the step's own policy version sampled), split into those and
    the older ones."""
    counted = mask != 0
    gap = torch.where(counted, (logprobs.detach() - old).abs(), 0.0).to(torch.float64)
    parts = {"": counted}
    if same is not None:
        parts |= {"_same_version": counted & same, "_older": counted & ~same}
    for suffix, where in parts.items():
        n = where.sum().to(gap)
        if suffix:  # a split of no tokens (no older one in a synchronous run) reports nothing
            out.add_sum(f"{HIDDEN}tokens:{suffix}", n)
        out.add_mean(f"{PREFIX}token_mult_prob_error{suffix}", torch.where(where, torch.exp(gap), 0.0).sum(), n)
        out.add_mean(f"{ABS_DIFF}{suffix}", torch.where(where, gap, 0.0).sum(), n)


def add_metrics(
    out: LossOutput, fixed: Corrected, old, mask, same_version=None, is_scale=None, first_update: bool = True
) -> None:
    """Every rollout_corr/ metric of one micro-batch, over the tokens given, rejected ones included
    (verl measures before it rejects). The staleness metrics only on the first update of a rollout
    batch: later updates measure weights that moved since the engine sampled (training drift, not
    the engine's gap), as Miles, slime and NeMo-RL measure them once per step before training. The
    rest describe the weights and masks each update applies, as verl's bypass mode does."""
    cfg, c, seqs, measured = fixed.cfg, fixed.correction, fixed.sequences, fixed.measured
    offpolicy_metrics(out, measured, old, mask, seqs)
    if first_update:
        staleness_metrics(out, measured, old, mask, same_version)
    if cfg.rollout_is is not None:
        is_metrics(out, c, mask, seqs, cfg)
        if cfg.rollout_is_batch_normalize:
            one = is_scale.new_ones((), dtype=torch.float64)
            out.add_mean(PREFIX + "rollout_is_batch_norm_factor", is_scale, one)
    rs_metrics(out, c.rejections, mask, seqs)


def finish(metrics: dict[str, float]) -> dict[str, float]:
    """The reduced metrics with the hidden parts replaced by their metrics (std, ESS)."""
    parts: dict[str, dict[str, float]] = {}
    for key in [k for k in metrics if k.startswith(HIDDEN)]:
        name, _, part = key[len(HIDDEN) :].rpartition(":")
        parts.setdefault(name, {})[part] = metrics.pop(key)
    for suffix, count in parts.pop("tokens", {}).items():
        if count == 0:
            for name in ("token_mult_prob_error", "train_rollout_logprob_abs_diff"):
                metrics.pop(PREFIX + name + suffix, None)
    for key in [k for k in metrics if k.startswith(PREFIX) and k.endswith(("_max", "_min", "_deviation"))]:
        if math.isinf(metrics[key]):  # the extreme of nothing (no token, no sequence): 0, as verl's empty case
            metrics[key] = 0.0
    for name, p in parts.items():
        if "m1" in p:  # a token std over the clamped values
            metrics[PREFIX + name + "_std"] = math.sqrt(max(p["m2"] - p["m1"] ** 2, 0.0))
            if name == "rollout_is":  # verl's ESS: 1 / mean((w / (mean w + eps))^2)
                ess = p["m2"] / (p["m1"] + EPS) ** 2
                metrics[PREFIX + "rollout_is_eff_sample_size"] = 1.0 / ess if ess > 0 else 0.0
        else:
            n, s, ss = p["n"], p["s"], p["ss"]
            metrics[PREFIX + name] = math.sqrt(max(ss - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0
    return metrics
