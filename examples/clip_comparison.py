"""BAPO against fixed clipping on a synthetic off-policy task, on CPU in seconds.

    python examples/clip_comparison.py                     # bapo vs ppo vs clip_higher
    python examples/clip_comparison.py --losses bapo ppo --steps 80 --staleness 4

Each prompt has a hidden target sequence; a response earns the fraction of its tokens that
match. The policy is a table of logits per (prompt, position), initialised so that the
target tokens start improbable: learning them means pushing up low-probability positive
tokens, exactly the updates a fixed upper clip bound blocks. Rollouts come from a policy
`staleness` versions old and each batch feeds several optimizer steps, so the ratios
pi / mu drift far from 1, as with partial rollout or asynchronous generation. Every loss
sees the same seed, prompts and schedule.
"""

from __future__ import annotations

import argparse
import collections
import json
from dataclasses import dataclass

import torch

from bapo_megatron.algo import (
    PRESETS,
    AdvantageConfig,
    PolicyBatch,
    PolicyLossConfig,
    group_advantages,
    policy_loss,
    reduce_metrics,
)
from bapo_megatron.algo.bapo import bapo_preset


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    prompts: int = 32
    length: int = 8
    vocab: int = 32
    samples_per_prompt: int = 8
    prompts_per_step: int = 16
    steps: int = 100
    staleness: int = 4
    """Rollouts are sampled by the policy this many optimizer steps old."""
    updates_per_batch: int = 4
    lr: float = 0.3
    seed: int = 0


class SequenceTask:
    """Hidden targets per prompt and a tabular policy whose targets start improbable."""

    def __init__(self, cfg: TaskConfig) -> None:
        g = torch.Generator().manual_seed(cfg.seed)
        self.cfg = cfg
        self.targets = torch.randint(cfg.vocab, (cfg.prompts, cfg.length), generator=g)
        init = torch.randn(cfg.prompts, cfg.length, cfg.vocab, generator=g)
        init.scatter_(2, self.targets.unsqueeze(2), 1.0)  # the right token starts improbable (~5%)
        self.init_logits = init

    def sample(self, logits: torch.Tensor, prompt_ids: torch.Tensor, n: int, g: torch.Generator):
        """n responses per prompt: tokens [B, L] and the behaviour log-probs of each token."""
        probs = torch.softmax(logits[prompt_ids], dim=-1).repeat_interleave(n, dim=0)  # [B, L, V]
        tokens = torch.multinomial(probs.reshape(-1, self.cfg.vocab), 1, generator=g).view(probs.shape[:2])
        logp = torch.log(probs.gather(2, tokens.unsqueeze(2)).squeeze(2))
        return tokens, logp

    def reward(self, prompt_ids: torch.Tensor, tokens: torch.Tensor, n: int) -> torch.Tensor:
        targets = self.targets[prompt_ids].repeat_interleave(n, dim=0)
        return (tokens == targets).float().mean(dim=1)


def run(loss_cfg: PolicyLossConfig, cfg: TaskConfig, log=None) -> list[dict[str, float]]:
    """Train one policy with `loss_cfg`; one row of metrics per optimizer step."""
    task = SequenceTask(cfg)
    logits = task.init_logits.clone().requires_grad_()
    optimizer = torch.optim.Adam([logits], lr=cfg.lr)
    history = collections.deque([logits.detach().clone()], maxlen=cfg.staleness + 1)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    rows: list[dict[str, float]] = []
    step = 0
    while step < cfg.steps:
        prompt_ids = torch.randperm(cfg.prompts, generator=g)[: cfg.prompts_per_step]
        behaviour = history[0]  # the oldest weights kept: `staleness` steps behind
        tokens, old_logp = task.sample(behaviour, prompt_ids, cfg.samples_per_prompt, g)
        rewards = task.reward(prompt_ids, tokens, cfg.samples_per_prompt)
        adv, adv_metrics = group_advantages(rewards.view(-1, cfg.samples_per_prompt), AdvantageConfig())
        adv = adv.reshape(-1, 1).expand_as(old_logp)
        rows_per_update = len(tokens) // cfg.updates_per_batch
        for update in range(cfg.updates_per_batch):
            if step >= cfg.steps:
                break
            part = slice(update * rows_per_update, (update + 1) * rows_per_update)
            per_prompt = prompt_ids.repeat_interleave(cfg.samples_per_prompt)[part]
            log_probs = torch.log_softmax(logits[per_prompt], dim=-1)
            logp = log_probs.gather(2, tokens[part].unsqueeze(2)).squeeze(2)
            entropy = -(log_probs.exp() * log_probs).sum(-1)
            batch = PolicyBatch(
                logprobs=logp,
                old_logprobs=old_logp[part],
                advantages=adv[part],
                mask=torch.ones_like(logp),
                entropy=entropy,
                first_update=update == 0,
            )
            out = policy_loss(batch, loss_cfg)
            optimizer.zero_grad()
            (out.loss_sum / out.token_count).backward()
            optimizer.step()
            history.append(logits.detach().clone())
            row = {"step": step, "rollout/reward_mean": rewards.mean().item(), **reduce_metrics([out])}
            row["advantage/zero_group_frac"] = adv_metrics["advantage/zero_group_frac"]
            rows.append(row)
            if log is not None:
                log(loss_cfg.loss, row)
            step += 1
    return rows


COLUMNS = [
    ("reward", "rollout/reward_mean"),
    ("entropy", "policy/entropy"),
    ("c_low", "bapo/clip_low"),
    ("c_high", "bapo/clip_high"),
    ("rho", "bapo/rho"),
    ("rho_start", "bapo/rho_start"),
    ("clip_hi%", "bapo/clipfrac_high"),
    ("r_max", "policy/ratio_max"),
]


def _print_row(name: str, row: dict[str, float]) -> None:
    cells = []
    for label, key in COLUMNS:
        value = row.get(key, float("nan"))
        cells.append(f"{100 * value:>{len(label)}.1f}" if label.endswith("%") else f"{value:>{max(len(label), 6)}.3f}")
    print(f"{name:<12} {int(row['step']):>4} " + " ".join(cells))


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", default=["bapo", "ppo", "clip_higher"])
    parser.add_argument("--bapo-preset", default="seed", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=TaskConfig.steps)
    parser.add_argument("--staleness", type=int, default=TaskConfig.staleness)
    parser.add_argument("--every", type=int, default=10, help="print one row per this many steps")
    parser.add_argument("--json", help="write every row of every run to this file")
    args = parser.parse_args(argv)
    cfg = TaskConfig(steps=args.steps, staleness=args.staleness)
    print(
        f"synthetic off-policy task: {cfg.prompts} prompts, {cfg.length} tokens, vocab {cfg.vocab}, "
        f"rollouts {cfg.staleness} steps stale, {cfg.updates_per_batch} updates per batch"
    )
    print(f"{'loss':<12} {'step':>4} " + " ".join(f"{label:>{max(len(label), 6)}}" for label, _ in COLUMNS))

    def log(name, row):
        if row["step"] % args.every == 0 or row["step"] == cfg.steps - 1:
            _print_row(name, row)

    results = {}
    for name in args.losses:
        loss_cfg = PolicyLossConfig(loss=name, bapo=bapo_preset(args.bapo_preset))
        results[name] = run(loss_cfg, cfg, log)
    tail = max(1, cfg.steps // 6)
    print(f"\nmean over the last {tail} steps:")
    for name, rows in results.items():
        last = rows[-tail:]
        mean = {
            k: sum(r[k] for r in last) / len(last)
            for k in ("rollout/reward_mean", "policy/entropy", "bapo/clip_high", "bapo/rho")
        }
        print(
            f"  {name:<12} reward {mean['rollout/reward_mean']:.3f}  entropy {mean['policy/entropy']:.3f}  "
            f"c_high {mean['bapo/clip_high']:.2f}  rho {mean['bapo/rho']:.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return results


if __name__ == "__main__":
    main()
