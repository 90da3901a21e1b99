"""The rollout correction's cost on the demo's CPU step: the loss with its rollout_corr/ metrics,
off and in each mode, against the loss alone, as a share of the demo's measured train step.

    python benchmarks/bench_rollout_corr.py                          # the demo's shape, every mode
    python benchmarks/bench_rollout_corr.py --modes off token_tis --repeats 100
    python benchmarks/bench_rollout_corr.py --step-s 0.57 --step-repeats 0   # a step measured elsewhere

The demo (examples/demo/rl.yaml): BAPO, 32 prompts x 8 samples a step in 2 updates, prompts of 8
tokens ("325+350=") and answers of 5 (4 digits and <eos>), tokens of 3 policy versions (async,
max_staleness 2), the tiny task model (hidden 128 x 4 layers), one micro-batch an update. The
step is measured in process as the trainer runs it (train.update: both updates of one batch, the
prepass folded), correction off. The loss rows time, on the micro-batch the trainer builds for one
update, policy_loss's forward and backward and the reduction of its metrics to floats; the loss
alone is algo.loss with no correction code and no rollout_corr/ metric (what an update cost before
issue 45). A mode's extra is its loss row less the loss alone, plus its correction in the prepass
(decoupled modes, beyond what "off" computes there), times the step's updates. The step rows
(--step-repeats) time the whole step in each mode, in interleaved rounds: a check on the extras,
within the machine's noise. On a machine busy with other work, --clock cpu --threads 1 counts the
process's own CPU time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

import torch

from bapo_megatron.algo.losses import POLICY_LOSSES, PolicyBatch, policy_loss
from bapo_megatron.algo.metrics import reduce_metrics
from bapo_megatron.algo.rollout_corr_metrics import finish
from bapo_megatron.algo.rollout_correction import Sequences, apply_correction, batch_mean_parts
from bapo_megatron.common.batch import RolloutBatch, Sample

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo" / "rl.yaml"
PROMPT, ANSWER, VERSION = 8, 5, 2
"""The demo's prompt and answer lengths in tokens, and the policy version of the step's weights."""

MODES = {
    "off": [],
    "token_tis": ["rollout_is=token", "rollout_is_threshold=2.0"],
    "token_icepop": ["rollout_is=token", "rollout_is_threshold=0.5_2.0"],
    "token_tis_normalised": ["rollout_is=token", "rollout_is_threshold=2.0", "rollout_is_batch_normalize=true"],
    "sequence_masked": ["rollout_is=sequence", "rollout_is_threshold=0.5_2.0"],
    "geometric_rejection": ["rollout_rs=seq_mean_k1", "rollout_rs_threshold=0.5_2.0"],
    "token_k1_seq_k3_rejection": ["rollout_rs=token_k1,seq_mean_k3", "rollout_rs_threshold=2.0"],
    "bypass_ppo_clip": ["bypass_mode=true", "rollout_is=token"],
    "bypass_reinforce": ["bypass_mode=true", "loss_type=reinforce", "rollout_is=token"],
}
"""algo.rollout_correction keys (verl's) of each mode; "off" reports the metrics only."""


def demo_config(mode: str):
    from bapo_megatron.config import load_config

    keys = [f"algo.rollout_correction.{k}" for k in MODES[mode]]
    loss = ["algo.loss=ppo"] if "loss_type=reinforce" in MODES[mode] else []  # reinforce is verl's ppo
    return load_config(DEMO, ["optimizer.lr=1e-6", "checkpoint.save=false", *loss, *keys])


def demo_batch(cfg, vocab: int, seed: int = 0) -> RolloutBatch:
    """One step's samples in the demo's shape: random tokens, behaviour log-probs near a random
    model's (-ln vocab), each answer token of one of the last 3 policy versions."""
    rng = random.Random(seed)
    samples = []
    for group in range(cfg.rollout.prompts_per_step):
        prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
        for _ in range(cfg.rollout.samples_per_prompt):
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=[rng.randrange(vocab) for _ in range(ANSWER)],
                    behaviour_logprobs=[-2.8 + rng.gauss(0, 0.3) for _ in range(ANSWER)],
                    versions=[VERSION - rng.randrange(3) for _ in range(ANSWER)],
                    reward=float(rng.random() < 0.5),
                    group=group,
                )
            )
    return RolloutBatch(samples=samples, metadata={"version": str(VERSION)})


def loss_batch(trainer, batch: RolloutBatch, updates: int) -> PolicyBatch:
    """The PolicyBatch of the first update's micro-batch, as the trainer builds it; the trainer's
    log-probs 0.1 (in log space) off the engine's, pi_prox beside them."""
    from bapo_megatron.train import split_groups

    mbs, _ = trainer.microbatches(split_groups(batch, updates)[0])
    assert len(mbs) == 1, f"{len(mbs)} micro-batches an update: the demo has one"
    mb = mbs[0]
    g = torch.Generator().manual_seed(1)
    counted = mb.loss_mask > 0
    logp = torch.where(counted, mb.old_logprobs + 0.1 * torch.randn(mb.old_logprobs.shape, generator=g), 0.0)
    count = len(mb.sample_index)
    seqs = (
        Sequences.rows(mb.loss_mask.shape, count, mb.loss_mask.device)
        if mb.cu_seqlens is None
        else Sequences.packed(mb.cu_seqlens, count, mb.loss_mask.shape[1])
    )
    return PolicyBatch(
        logprobs=logp.clamp(max=0.0),
        old_logprobs=mb.old_logprobs,
        advantages=mb.advantages,
        mask=mb.loss_mask,
        prox_logprobs=logp.clamp(max=0.0),
        entropy=torch.rand(logp.shape, generator=g),
        sequences=seqs,
        same_version=mb.versions == VERSION,
        is_scale=torch.ones((), dtype=torch.float64),
    )


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""wall: seconds as the other benchmarks time them; cpu: this process's CPU seconds (every thread's),
which a machine busy with other work inflates far less (use with --threads 1)."""


def median_ms(fn, repeats: int, clock) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return 1e3 * statistics.median(times)


def loss_ms(batch: PolicyBatch, algo, alone: bool, repeats: int, clock) -> float:
    """Forward and backward of the loss and its metrics' reduction to floats, as the trainer's step
    does them: policy_loss, or algo.loss alone (no correction, no rollout_corr/ metric)."""

    def run():
        lp = batch.logprobs.detach().requires_grad_()
        b = PolicyBatch(**{**batch.__dict__, "logprobs": lp})
        out = POLICY_LOSSES[algo.loss](b, algo) if alone else policy_loss(b, algo)
        (out.loss_sum / out.token_count).backward()
        finish(reduce_metrics([out]))

    return median_ms(run, repeats, clock)


def prepass_ms(batch: PolicyBatch, algo, repeats: int, clock) -> float:
    """The correction the prepass computes for BAPO's table and batch normalisation (trainer._stats)."""
    corr, lp = algo.correction, batch.prox_logprobs

    def run():
        fixed = apply_correction(lp, lp, batch.old_logprobs, batch.mask, batch.sequences, corr, lp.new_ones(()))
        if corr.rollout_is_batch_normalize:
            batch_mean_parts(fixed.correction, batch.mask, batch.sequences, corr.rollout_is)

    return median_ms(run, repeats, clock)


def build_trainers(modes: list[str]) -> dict:
    """A trainer of the demo's model and config in each mode (the same seed: the same weights)."""
    from bapo_megatron.models.spec import ModelSpec
    from bapo_megatron.tasks import tiny_config
    from bapo_megatron.trainer.parallel import init_model_parallel
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer

    spec = ModelSpec.from_hf_config(tiny_config("qwen2"))
    info, trainers = None, {}
    for mode in modes:
        cfg = demo_config(mode)
        info = info or init_model_parallel(cfg.parallel, cfg.seed)
        trainers[mode] = PolicyTrainer(spec, cfg, info)
    return trainers


def step_times(trainers: dict, batch: RolloutBatch, repeats: int, clock) -> dict[str, list[float]]:
    """Seconds of the demo's train step (train.update: its updates of one batch) in each mode,
    `repeats` rounds over the modes after a warm-up round, so a slow spell hits every mode."""
    from bapo_megatron.train import update

    times = {mode: [] for mode in trainers}
    for _ in range(repeats + 1):
        for mode, trainer in trainers.items():
            start = clock()
            update(trainer, batch, trainer.cfg.algo.updates_per_batch)
            times[mode].append(clock() - start)
    return {mode: t[1:] for mode, t in times.items()}


def loss_rows(trainers: dict, batch: PolicyBatch, repeats: int, clock) -> list[dict]:
    """Per mode: the loss with its metrics, its extra over the loss alone, the prepass's correction
    (decoupled modes, beyond what "off" computes there), in ms an update."""
    alone, rows = {}, []
    for mode, trainer in trainers.items():
        algo = trainer.cfg.algo
        if algo.loss not in alone:
            alone[algo.loss] = loss_ms(batch, algo, True, repeats, clock)
            rows.append({"mode": f"alone({algo.loss})", "loss": alone[algo.loss]})
        total = loss_ms(batch, algo, False, repeats, clock)
        prepass = prepass_ms(batch, algo, repeats, clock) if trainer._needs_prepass() else 0.0
        rows.append({"mode": mode, "loss": total, "extra": total - alone[algo.loss], "prepass": prepass})
    off = next(r["prepass"] for r in rows if r["mode"] == "off")
    for r in rows:
        if "prepass" in r:
            r["prepass"] = max(r["prepass"] - off, 0.0) if r["mode"] != "off" else 0.0
    return rows


def _spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} ({min(times):.3f}-{max(times):.3f})"


def print_table(rows: list[dict], steps: dict, step_s: float, updates: int, shape: str) -> None:
    print(shape)
    head = (
        f"{'mode':<26} {'loss ms':>11} {'extra ms':>9} {'prepass ms':>10} {'extra/step ms':>13} "
        f"{'of step':>8}  {'step s, median (min-max)':<26} {'vs off':>7}"
    )
    print(head)
    print("-" * len(head))
    off = statistics.median(steps["off"]) if steps else None
    for r in rows:
        line = f"{r['mode']:<26} {r['loss']:>11.2f}"
        if "extra" in r:
            per_step = updates * (r["extra"] + r["prepass"])
            line += f" {r['extra']:>9.2f} {r['prepass']:>10.2f} {per_step:>13.2f} {per_step / (1e3 * step_s):>8.2%}"
            if r["mode"] in steps:
                median = statistics.median(steps[r["mode"]])
                line += f"  {_spread(steps[r['mode']]):<26} {median / off - 1:>+7.1%}"
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=50, help="timed loss calls a row (median)")
    parser.add_argument("--step-repeats", type=int, default=5, help="timed demo steps a mode (0: none)")
    parser.add_argument("--step-s", type=float, default=None, help="the demo step's seconds (default: measured)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--clock", choices=list(CLOCKS), default="wall", help="cpu: the process's CPU seconds (a busy machine)"
    )
    args = parser.parse_args(argv)
    if args.step_s is None and args.step_repeats < 1:
        parser.error("--step-repeats 0 needs --step-s (the step the extras are a share of)")
    if args.threads:
        torch.set_num_threads(args.threads)
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_distributed, single_process_env

    activate_cpu_shim()
    single_process_env()
    init_distributed()
    trainers = build_trainers(["off", *(m for m in args.modes if m != "off")])
    off = trainers["off"]
    updates, cfg = off.cfg.algo.updates_per_batch, off.cfg
    batch = demo_batch(cfg, off.spec.vocab_size)
    policy_batch = loss_batch(off, batch, updates)
    clock = CLOCKS[args.clock]
    steps = step_times(trainers, batch, args.step_repeats, clock) if args.step_repeats else {}
    step_s = args.step_s if args.step_s is not None else statistics.median(steps["off"])
    counted = int((policy_batch.mask > 0).sum())
    shape = (
        f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"load {os.getloadavg()[0]:.2f}; "
        f"the demo's step: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.samples_per_prompt} samples "
        f"in {updates} updates of one micro-batch, {tuple(policy_batch.mask.shape)} positions and {counted} "
        f"counted tokens each; step {step_s:.3f} s ({'measured, off' if args.step_s is None else 'given'}); "
        f"loss rows: median of {args.repeats}, step rows: {args.step_repeats} rounds"
    )
    print_table(loss_rows(trainers, policy_batch, args.repeats, clock), steps, step_s, updates, shape)


if __name__ == "__main__":
    main()
