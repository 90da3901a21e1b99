"""The run's logs: one metric logger with backends (console, jsonl, wandb, tensorboard), metrics as dicts
with slash names; what each step trains on (samples.jsonl, rollouts.jsonl, batches/).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

from bapo_megatron.config import LoggingConfig
from bapo_megatron.run_checks import RunChecks

if TYPE_CHECKING:
    from bapo_megatron.common.batch import RolloutBatch

CONSOLE_KEYS = (
    "rollout/reward_mean",
    "loss/pg",
    "loss/sft",
    "sft/answer_acc",
    "bapo/clip_low",
    "bapo/clip_high",
    "bapo/rho",
    "policy/entropy",
    "train/grad_norm",
    "train/skipped",
)

EVAL_SHOWN = ("greedy_acc", "avg@", "pass@")
"""Held-out figures shown on the console: eval/X and each named set's eval/NAME/X."""


NO_SIGNAL_PLACEHOLDERS = ("bapo/rho", "bapo/rho_start")
"""Figures a step whose tokens carry no advantage only fills in (a share of nothing: BAPO's search
says 1); such a step's lines and plots leave them out."""


def trained_nothing(metrics: dict) -> bool:
    """Whether a step's updates had no token with an advantage (every group's rewards equal: its
    gradient is 0): policy/signal_tokens, the share of tokens with one, is 0 (in logs from before it
    was logged, advantage/zero_group_frac is 1)."""
    if "policy/signal_tokens" in metrics:
        return metrics["policy/signal_tokens"] == 0
    return metrics.get("advantage/zero_group_frac") == 1


def without_placeholders(metrics: dict) -> dict:
    """`metrics` less NO_SIGNAL_PLACEHOLDERS where the step trained nothing."""
    if not trained_nothing(metrics):
        return metrics
    return {k: v for k, v in metrics.items() if k not in NO_SIGNAL_PLACEHOLDERS}


def shown_eval(key: str) -> bool:
    return key.startswith("eval/") and key.rsplit("/", 1)[-1].startswith(EVAL_SHOWN)


def console_label(key: str) -> str:
    """The last part of a metric's name; a named evaluation set's keeps its name (aime24/pass@16)."""
    return key.removeprefix("eval/") if shown_eval(key) else key.split("/")[-1]


class MetricLogger:
    """Send each step's metrics to every configured backend; a no-op on ranks that do not log."""

    def __init__(
        self,
        cfg: LoggingConfig,
        *,
        job_name: str,
        config: dict,
        enabled: bool = True,
        run_dir: str | Path = ".",
        resume_step: int | None = None,
    ) -> None:
        """resume_step: a resumed run's first step is after it; lines of later steps (written by the
        interrupted run after its last checkpoint) are dropped from the jsonl file, so that it holds
        one timeline."""
        self.cfg = cfg
        self.enabled = enabled
        self._jsonl = None
        self._wandb = None
        self._tensorboard = None
        if not enabled:
            return
        if "jsonl" in cfg.backends:
            path = Path(cfg.jsonl_path) if cfg.jsonl_path else Path(run_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            truncate_after(path, resume_step)
            self._jsonl = path.open("a")
        if "wandb" in cfg.backends:
            import wandb

            # offline (a run directory under run_dir/wandb, `wandb sync` later) unless a key is set
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self._wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.wandb_run_name or job_name,
                config=config,
                mode=mode,
                dir=str(Path(run_dir)),
            )
        if "tensorboard" in cfg.backends:
            directory = Path(cfg.tensorboard_dir) if cfg.tensorboard_dir else Path(run_dir) / "tensorboard"
            self._tensorboard = tensorboard_writer(directory, config, resume_step)
        self._start = time.monotonic()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled or step % self.cfg.interval:
            return
        metrics = without_placeholders(metrics)
        if "console" in self.cfg.backends:
            keys = [k for k in CONSOLE_KEYS if k in metrics] + sorted(k for k in metrics if shown_eval(k))
            shown = " ".join(f"{console_label(k)}={metrics[k]:.4g}" for k in keys)
            print(f"step {step:>5} {shown} ({time.monotonic() - self._start:.1f}s)", file=sys.stdout, flush=True)
        if self._jsonl is not None:
            clean = {k: (v if math.isfinite(v) else None) for k, v in metrics.items()}
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._tensorboard is not None:
            for name, value in metrics.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            self._tensorboard.flush()  # a step's figures on disk as the jsonl line is

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()


def tensorboard_writer(directory: Path, config: dict, resume_step: int | None):
    """A SummaryWriter into `directory` holding the run's config as text (once: at step 0). Events of
    steps after `resume_step` (a new run: every one) that an earlier run left there are hidden from
    tensorboard, so that it shows one timeline, as metrics.jsonl holds one."""
    import yaml
    from torch.utils.tensorboard import SummaryWriter

    directory.mkdir(parents=True, exist_ok=True)
    writer = SummaryWriter(str(directory), purge_step=0 if resume_step is None else resume_step + 1)
    if resume_step is None:
        # indented four spaces: shown as written (the text panel renders markdown)
        text = yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
        writer.add_text("config", "".join(f"    {line}\n" for line in text.splitlines()), global_step=0)
    return writer


def truncate_after(path: Path, step: int | None) -> None:
    """A resumed run's jsonl log keeps its records up to `step` (None, a new run: none), so that it
    holds one timeline; nothing to do when the file does not exist."""
    if path.is_file():
        keep_lines(path, lambda record: step is not None and record.get("step", 0) <= step)


def keep_lines(path: Path, keep) -> None:
    """Rewrite a jsonl file (atomically) keeping the records for which keep(record) is true."""
    from bapo_megatron.fsutil import write_text_atomic

    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if isinstance(record, dict) and keep(record):
            kept.append(line + "\n")
    write_text_atomic(path, "".join(kept))


class RolloutLog:
    """The samples a step trains on, as text, in rollouts.jsonl: one line a sample, the step's first
    `count` samples (its batch's first groups, whole, in batch order: the same ones on a rerun).
    Each line holds the step, the group's uid and the sample's index in it, the prompt and response
    (decoded; their token ids where there is no tokenizer), the record's answer and data_source, the
    reward (and why its call failed), the lengths in tokens, the finish reason, the oldest and
    newest policy version among the response's tokens (they differ where partial rollout continued
    it under newer weights), how often staleness made it be generated again, and how many of its
    tokens are older than the staleness bound lets the step train on (left out of the loss).
    Written with json.dumps (the text is the model's and the data's: escaped, never formatted in);
    a step's lines in one write, so a kill leaves at most its last line cut (keep_lines skips it).
    A resumed run cuts the file back to its checkpoint's step (truncate_after), as metrics.jsonl."""

    def __init__(self, path: str | Path, count: int, decode: Callable[[list[int]], str] | None) -> None:
        """decode: token ids to text (None: the model has no tokenizer; the ids are written)."""
        self.path, self.count, self.decode = Path(path), count, decode

    def write(self, step: int, groups: Sequence, oldest_allowed: int) -> None:
        """groups: the step's prompt groups in batch order (rollout/buffer.GroupState: uid, prompt_ids,
        meta, samples); oldest_allowed: the oldest token version the step may train on."""
        lines = [json.dumps(r, default=str) + "\n" for r in self.records(step, groups, oldest_allowed)]
        if lines:
            with self.path.open("a") as f:
                f.write("".join(lines))

    def records(self, step: int, groups: Sequence, oldest_allowed: int) -> list[dict]:
        chosen = [(g, i, s) for g in groups for i, s in enumerate(g.samples)][: self.count]
        return [self.record(step, g, i, s, oldest_allowed) for g, i, s in chosen]

    def record(self, step: int, group, index: int, sample, oldest_allowed: int) -> dict:
        prompt, response = group.prompt_ids, sample.response_ids
        text = {"prompt": self.decode(prompt), "response": self.decode(response)} if self.decode else {}
        ids = {} if self.decode else {"prompt_ids": list(prompt), "response_ids": list(response)}
        meta = {k: group.meta[k] for k in ("data_source", "answer") if k in group.meta}
        reward = sample.reward if sample.reward is not None and math.isfinite(sample.reward) else None
        failed = {"reward_error": sample.reward_error} if sample.reward_error else {}
        return {
            "step": step,
            "group": group.uid,
            "sample": index,
            **text,
            **ids,
            **meta,
            "reward": reward,
            **failed,
            "prompt_tokens": len(prompt),
            "response_tokens": len(response),
            "finish": sample.finish,
            "version_min": min(sample.versions, default=None),
            "version_max": max(sample.versions, default=None),
            "regenerated": sample.regenerated,
            "stale_tokens": sum(v < oldest_allowed for v in sample.versions),
        }


class StepRecords:
    """What each step trains on, beside metrics.jsonl in the run directory: samples.jsonl (the uids
    of its prompt groups), rollouts.jsonl (its first samples as text: RolloutLog) and, with
    logging.save_batches, the batch itself in batches/ (rollout.replay=<run_dir>/batches trains the
    trainer's half alone from them, later). A resumed run cuts the two logs back to its checkpoint."""

    LOGS = ("samples.jsonl", "rollouts.jsonl")

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig, decode: Callable[[list[int]], str] | None) -> None:
        """decode: token ids to text (None: the model has no tokenizer; rollouts.jsonl holds the ids)."""
        self.run_dir, self.save_batches = Path(run_dir), cfg.save_batches
        self.rollouts = RolloutLog(self.run_dir / "rollouts.jsonl", cfg.samples, decode)

    def truncate_after(self, step: int | None) -> None:
        """One timeline with metrics.jsonl: a resumed run keeps the lines up to its checkpoint's
        `step`, a new one (None) none."""
        for name in self.LOGS:
            truncate_after(self.run_dir / name, step)

    def write(self, step: int, groups: Sequence, batch: RolloutBatch, oldest_allowed: int) -> None:
        """groups: the step's prompt groups in batch order (rollout/buffer.GroupState); batch: the
        batch made of them; oldest_allowed: the oldest token version it trains on."""
        with (self.run_dir / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "groups": [g.uid for g in groups]}) + "\n")
        self.rollouts.write(step, groups, oldest_allowed)
        if self.save_batches:
            (self.run_dir / "batches").mkdir(exist_ok=True)
            batch.save(self.run_dir / "batches" / f"step_{step:08d}.safetensors")


class StepLog:
    """Each step's line, in step order, written once the held-out evaluation it started (if any) has
    its figures: an evaluation runs beside the next step and reports in the line of the step whose
    weights it measured. `flush` waits for whatever is pending (before a checkpoint, at the end).
    Each step's metrics pass logging.checks as they are recorded (run_checks.CheckFailed: the run
    stops at that step, its line written or pending)."""

    def __init__(self, logger: MetricLogger) -> None:
        self.logger = logger
        self.checks = RunChecks(logger.cfg.checks)
        self.pending: list[tuple[int, dict[str, float], Future | None]] = []
        self.history: list[dict[str, float]] = []
        self.step: int | None = None  # the last step recorded
        self._carried: dict[str, float] = {}

    def record(self, step: int, metrics: dict[str, float], evaluation: Future | None = None) -> None:
        self.pending.append((step, {**self._carried, **metrics}, evaluation))
        self.step = step
        self._carried = {}
        self._write(wait=False)
        self.checks.step(step, metrics)  # on every rank: the trainer's figures are each rank's

    def carry(self, metrics: dict[str, float]) -> None:
        """Figures for the next line (a checkpoint's time, taken after its step's line was written)."""
        self._carried.update(metrics)

    def flush(self, evaluations: bool = True) -> None:
        """Write every pending line; evaluations=False (a failing run): without the figures of an
        evaluation still running, which could wait on what made the run fail."""
        self._write(wait=evaluations, drop_running=not evaluations)

    def _write(self, wait: bool, drop_running: bool = False) -> None:
        while self.pending:
            step, metrics, evaluation = self.pending[0]
            if evaluation is not None and not (drop_running and not evaluation.done()):
                if not (wait or evaluation.done()):
                    return
                metrics.update(evaluation.result())
            self.pending.pop(0)
            self.history.append(metrics)
            self.logger.log(step, metrics)
