"""The BAPO training loop: a batch, its policy updates, the new weights to the engines, a log line, a checkpoint.

    bapo-train CONFIG.yaml key=value ...                                # one process (CPU)
    torchrun --nproc-per-node 8 -m bapo_megatron.train CONFIG.yaml ...  # a parallel job
    bapo-train --help-config; bapo-train CONFIG.yaml --dry-run          # every field; what would run

Step s trains policy version s - 1 into version s on a batch from the run's source (sources.py):
an online run's rank 0 drives the engines (driver.py) and hands the batch to every rank; the
trainer takes algo.updates_per_batch optimizer steps on it; the new weights go to the engines
as version s. In rollout.mode sync the engines generate the batch while the trainer waits; in
async they go on generating while it trains. Set-up and teardown are job.py's, the command
line's options cli/'s.
"""

from __future__ import annotations

import sys
import time
import traceback

from bapo_megatron import cli
from bapo_megatron.common import quiet
from bapo_megatron.common.batch import RolloutBatch
from bapo_megatron.config import JobConfig, load_config
from bapo_megatron.errors import BadInputError, ConfigError, RunStopped
from bapo_megatron.job import AlreadyFinished, Job


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train for cfg.steps steps (resuming from the run's checkpoint when there is one); each step's
    metrics, as logged (none when the checkpoint is at the last step already: nothing to do)."""
    try:
        job = Job.start(cfg)
    except AlreadyFinished:  # said on rank 0
        return []
    try:
        return train(job)
    except Exception as err:  # every way a run fails is in status.json (RunStopped, bad data drawn mid-run, a bug)
        job.failed(err)
        raise
    finally:
        job.close()


def train(job: Job) -> list[dict[str, float]]:
    cfg, trainer, source, log = job.cfg, job.trainer, job.source, job.log
    step = job.step
    while step < cfg.steps and not job.should_stop(step):
        start = time.monotonic()
        batch, metrics = source.next_batch(step)  # waits for the engines (sync), or takes what they queued (async)
        if batch is None:  # a stop signal came during the rollout: the step is given up
            continue
        waited = time.monotonic() - start
        add(metrics, update(trainer, batch, cfg.algo.updates_per_batch))
        add(metrics, {"time/trainer_wait": waited, "time/train": time.monotonic() - start - waited})
        step += 1
        add(metrics, source.publish(trainer, step))  # the engines serve version `step` from here
        add(metrics, throughput(batch, time.monotonic() - start))
        log.record(step, metrics, source.evaluate(step))  # an evaluation runs beside the next step
        job.watch(step, metrics)  # stop_when's figures; a run that skips every update stops
        if job.checkpointer.due(step):
            job.checkpointer.save(trainer, step, log)
    job.finish(step)
    return log.history


def add(metrics: dict[str, float], more: dict[str, float]) -> None:
    """A step's metrics from another part of the step: names never collide (one would hide the other)."""
    assert not metrics.keys() & more.keys(), f"metric names collide: {sorted(metrics.keys() & more.keys())}"
    metrics.update(more)


def update(trainer, batch: RolloutBatch, updates: int) -> dict[str, float]:
    """`updates` optimizer steps on the batch's mini-batches of whole groups; their metrics averaged
    (train/skipped: how many were skipped; train/step: the optimizer's count after the last)."""
    results = [trainer.train_step(part, first_update=k == 0) for k, part in enumerate(split_groups(batch, updates))]
    metrics = {}
    for key in {key for r in results for key in r.metrics}:  # (some, as the first update's mismatch, not every one)
        values = [r.metrics[key] for r in results if key in r.metrics]
        metrics[key] = sum(values) / len(values)
    metrics["train/skipped"] = float(sum(r.skipped for r in results))
    metrics["train/step"] = results[-1].metrics["train/step"]
    return {**metrics, **shares(metrics)}


def shares(metrics: dict[str, float]) -> dict[str, float]:
    """The step's positive share of the loss and negative share of the tokens that carry an
    advantage, from their parts (absent when the step had no advantage to share)."""
    out = {}
    pos, neg = metrics.get("policy/positive_loss", 0.0), metrics.get("policy/negative_loss", 0.0)
    if pos + neg > 0:
        out["policy/positive_loss_share"] = pos / (pos + neg)
    negative, signal = metrics.get("policy/negative_tokens", 0.0), metrics.get("policy/signal_tokens", 0.0)
    if signal > 0:
        out["policy/negative_token_share"] = negative / signal
    return out


def split_groups(batch: RolloutBatch, parts: int) -> list[RolloutBatch]:
    """`parts` mini-batches of whole prompt groups, in order."""
    groups: dict[int, list] = {}
    for s in batch.samples:
        groups.setdefault(s.group, []).append(s)
    if len(groups) % parts:
        raise ValueError(f"rollout batch has {len(groups)} groups, not divisible into {parts} updates")
    keys = list(groups)
    size = len(keys) // parts
    return [
        RolloutBatch(
            samples=[s for g in keys[i * size : (i + 1) * size] for s in groups[g]],
            temperature=batch.temperature,
            metadata=batch.metadata,
        )
        for i in range(parts)
    ]


def throughput(batch: RolloutBatch, seconds: float) -> dict[str, float]:
    return {
        "time/step": seconds,
        "perf/tokens_per_s": sum(s.length for s in batch.samples) / max(seconds, 1e-9),
        "perf/samples_per_s": len(batch) / max(seconds, 1e-9),
    }


def main(argv: list[str] | None = None) -> None:
    """`bapo-train` (and python -m bapo_megatron.train): see cli/args.py for the options."""
    quiet.hold_known_warnings()  # before Megatron is imported: its known notices go to the run's warnings.log
    args = cli.parse_args(sys.argv[1:] or None if argv is None else argv)
    if args.help_config:
        print(cli.help_config())
        return
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            print(cli.dry_run_command(args, cfg))
            return
        run(cfg)  # every check that needs no model runs before any process group starts
    except KeyboardInterrupt:
        print("interrupted: engines stopped; resume from the last checkpoint with the same command", file=sys.stderr)
        raise SystemExit(130) from None
    except RunStopped as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    except (ConfigError, BadInputError) as err:
        # A config mistake or an unusable file is the user's to fix: say what, without a traceback.
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as err:  # a bug: its traceback, then the one line every failure ends with
        traceback.print_exc()
        print(f"error: {type(err).__name__}: {err} (internal: the traceback above says where)", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
