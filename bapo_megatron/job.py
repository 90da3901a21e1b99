"""A run's set-up and teardown, and what decides when it saves and when it ends.

`Job.start(cfg)` runs every check that needs no model first (bad input fails in seconds, before
any process group starts), then builds the trainer, resumes it from its checkpoint (or loads the
starting weights), and starts the batch source (sources.py: the engines of an online run serve
the trainer's weights when it returns). `job.close()` undoes it, whatever happened. A run that
starts over keeps an earlier start's logs; runinfo.Ending records how it ends. `RolloutOnly` is
--rollout-only's half of it: the engines, prompts and reward, no trainer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from bapo_megatron.cli.rollout_only import check_rollout_only
from bapo_megatron.common import quiet
from bapo_megatron.config import JobConfig, dump_config, parse_stop_when, to_dict
from bapo_megatron.errors import ConfigError, RunStopped
from bapo_megatron.fsutil import write_text_atomic
from bapo_megatron.logger import MetricLogger, StepLog
from bapo_megatron.plan import RunPlan, plan_run
from bapo_megatron.runinfo import (
    Ending,
    Interrupted,
    RunStatus,
    banner,
    check_resume,
    ending,
    identity,
    keep_earlier_logs,
    next_commands,
    rollout_banner,
)
from bapo_megatron.sources import BatchSource


class StopSignal:
    """SIGTERM/SIGUSR1 (checkpoint.save_on_signal): remembered, acted on at the next step boundary
    (all ranks agree, then save and exit 0). Without save_on_signal, SIGTERM ends the run at once,
    through its teardown (engines stopped; status.json "interrupted"), and SIGUSR1 is ignored."""

    def __init__(self, save_on_signal: bool) -> None:
        self.received: int | None = None
        self.previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only (tests call run() from elsewhere)
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self.previous[sig] = signal.signal(sig, self._remember if save_on_signal else self._end)

    def _remember(self, signum, frame) -> None:
        self.received = signum

    def _end(self, signum, frame) -> None:
        if signum == signal.SIGTERM:
            raise Interrupted(signum)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StopWhen:
    """`stop_when`: whether the mean of a metric over its last stop_window steps has crossed a value.
    Only ranks that compute the metric (the last pipeline stage) can decide (`local`); the job
    tells every rank with one collective, together with the signal."""

    def __init__(self, rule: str | None, window: int) -> None:
        self.rule = parse_stop_when(rule) if rule else None
        self.values: deque[float] = deque(maxlen=window)

    def add(self, metrics: dict[str, float]) -> None:
        if self.rule is not None and self.rule[0] in metrics:
            self.values.append(float(metrics[self.rule[0]]))

    def local(self) -> bool:
        if self.rule is None or len(self.values) < (self.values.maxlen or 1):
            return False
        _, op, value = self.rule
        mean = sum(self.values) / len(self.values)
        return mean >= value if op == ">=" else mean <= value

    def describe(self) -> str:
        name, op, value = self.rule
        return f"stop_when: the mean {name} of the last {len(self.values)} steps {op} {value:g}"


class Checkpointer:
    """Whole-run checkpoints (trainer/checkpoint.py) every checkpoint.interval steps and at the end,
    the source's state among them, taken while its rollout is quiesced, in cfg.checkpoint_path (the
    run's own <run_dir>/ckpt unless checkpoint.dir says otherwise). Each records `record`, the run's
    identity (runinfo.identity), which a resume compares with its own. With checkpoint.save false,
    nothing is saved or resumed."""

    def __init__(self, cfg: JobConfig, source: BatchSource, record: dict | None = None) -> None:
        from bapo_megatron.trainer.checkpoint import CheckpointManager

        self.interval = cfg.checkpoint.interval
        self.source = source
        self.record = record
        path = cfg.checkpoint_path
        self.manager = None
        if path is not None:
            self.manager = CheckpointManager(replace(cfg.checkpoint, dir=str(path)), dump_config(cfg), record)
            self.manager.register(source.name, source)

    def check_start(self, cfg: JobConfig) -> Path | None:
        """The step directory the run resumes from (None: a new run). A wrong start fails in seconds:
        a fresh run over checkpoints, a resume from a broken one, or from another run's (runinfo)."""
        from bapo_megatron.trainer.integrity import verify_integrity

        if self.manager is None:
            return None
        rank = int(os.environ.get("RANK", "0"))
        self.manager.check_start(cfg.checkpoint.resume, rank)
        latest = self.manager.latest() if cfg.checkpoint.resume else None
        if latest is None:
            return None
        verify_integrity(latest, check_contents=False)
        notice = check_resume(latest, self.record, cfg.checkpoint.allow_foreign) if self.record else None
        if notice and rank == 0:
            print(notice, file=sys.stderr, flush=True)
        return latest

    def resume(self, trainer) -> int | None:
        """The step the run resumes at (everything restored), or None: a new run."""
        return self.manager.load(trainer) if self.manager is not None else None

    def due(self, step: int) -> bool:
        return self.manager is not None and bool(self.interval) and step % self.interval == 0

    def save(self, trainer, step: int, log: StepLog) -> None:
        """The step's lines first (a kill after the save never loses them), then the checkpoint; its
        seconds go in the next line."""
        if self.manager is None:
            return
        log.flush()
        start = time.monotonic()
        with self.source.quiesced():
            self.manager.save(trainer, step)
        log.carry({"time/checkpoint": time.monotonic() - start})


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def any_rank(*flags: bool) -> list[bool]:
    """Whether each flag is true on any rank: one all-reduce, every rank calling it at the same point."""
    t = torch.tensor([float(f) for f in flags], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def stopped_early_at(run_dir: Path, rule: str | None) -> int | None:
    """The step at which this run's stop_when ended it (status.json), if the same rule did."""
    status = RunStatus.read(run_dir)
    return status.step if status is not None and status.reason == "stop_when" and status.stop_when == rule else None


class AlreadyFinished(Exception):
    """The run's checkpoint is at its last step (or where its stop_when ended it): nothing to do."""


def finished_before(cfg: JobConfig, resume_from: Path | None) -> str | None:
    """Why a run that would resume from this step directory has nothing left to do (None: it has)."""
    from bapo_megatron.trainer.checkpoint import step_of

    if resume_from is None:
        return None
    step = step_of(resume_from)
    if step >= cfg.steps:
        return f"already finished at step {step}: nothing to do ({resume_from}; a larger steps= trains on)"
    if cfg.stop_when is not None and stopped_early_at(cfg.run_path, cfg.stop_when) == step:
        rule = cfg.stop_when
        return f"already finished at step {step}: nothing to do (stop_when {rule} ended it; another rule trains on)"
    return None


def plan(cfg: JobConfig, rank: int) -> RunPlan:
    """The run planned for its launcher's world and this process's GPU (plan.py, as the dry run plans
    for --world-size and --gpu-memory-gib): parallel.recompute=auto resolved, said on rank 0; a
    recompute set by hand that the estimate says does not fit, warned about."""
    from bapo_megatron.trainer.memory.fit import local_gpu_bytes

    planned = plan_run(cfg, int(os.environ["WORLD_SIZE"]), local_gpu_bytes())
    if rank == 0 and not planned.fits:
        warnings.warn(planned.recompute_line, stacklevel=2)
    elif rank == 0 and cfg.parallel.recompute == "auto":
        print(planned.recompute_line, flush=True)
    return planned


@dataclass
class Job:
    cfg: JobConfig
    rank: int
    source: BatchSource
    checkpointer: Checkpointer
    stop: StopSignal
    until: StopWhen
    trainer: object = None
    log: StepLog | None = None
    step: int = 0  # the step the run (re)started at
    resumed: bool = False
    own_group: bool = False
    ended: Literal["stop_when", "signal"] | None = field(default=None)  # once decided
    skipped_in_a_row: int = 0  # steps whose every update was skipped, up to the last
    resume_from: Path | None = None  # the step directory the run resumes from
    ending: Ending | None = None  # how the run ends, recorded (runinfo.Ending; one of its own if not given)

    def __post_init__(self) -> None:
        if self.ending is None:  # a job made by hand, not by start: its run has begun
            self.ending = Ending(self.cfg)
            self.ending.begin()

    @classmethod
    def start(cls, cfg: JobConfig, ending: Ending | None = None) -> Job:
        """The job, built; AlreadyFinished (said on rank 0) when its checkpoint leaves nothing to do.
        A run that starts over keeps the logs of an earlier start (runinfo.keep_earlier_logs)."""
        from bapo_megatron.preflight import check_starting_weights
        from bapo_megatron.sources import make_source
        from bapo_megatron.trainer.checkpoint import step_of
        from bapo_megatron.trainer.parallel import single_process_env

        single_process_env()
        rank = int(os.environ["RANK"])
        planned = plan(cfg, rank)
        cfg, spec = planned.cfg, planned.spec
        stop = StopSignal(cfg.checkpoint.save_on_signal)
        source = None
        try:
            source = make_source(cfg, spec, rank)
            source.stopping = lambda: stop.received is not None
            checkpointer = Checkpointer(cfg, source, identity(cfg, spec))
            job = cls(cfg, rank, source, checkpointer, stop, StopWhen(cfg.stop_when, cfg.stop_window), ending=ending)
            starting_weights = check_starting_weights(cfg)
            job.resume_from = job.checkpointer.check_start(cfg)
            if (done := finished_before(cfg, job.resume_from)) is not None:
                job.nothing_to_do(done)
        except BaseException:
            stop.restore()
            if source is not None:
                source.close()
            raise
        # the run directory is this run's once an earlier start's logs (status.json too) are set
        # aside: an interrupt from then on, the banner's printing included, is this run's to record
        kept = keep_earlier_logs(cfg) if rank == 0 and job.resume_from is None else None
        job.ending.begin()
        if rank == 0:  # what the run will do, before the engines and the trainer start
            print(banner(cfg, spec, planned.world_size, job.resume_from, starting_weights, kept), flush=True)
        job.ending.step = step_of(job.resume_from) if job.resume_from is not None else 0  # (an interrupt's)
        try:
            job._build(spec, starting_weights)
        except BaseException:
            job.close()
            raise
        return job

    def _load_starting_weights(self, starting_weights: bool) -> tuple[str, str | None]:
        """The run's starting weights into the trainer: model.mcore_path's, else model.hf_path's where
        it has weights, else the seed's initialisation left as built; (that field, its path)."""
        from bapo_megatron.trainer.checkpoint import weights_dir
        from bapo_megatron.weights.hf_load import load_hf_into_trainer

        model = self.cfg.model
        if model.mcore_path:
            self.trainer.load_weights(weights_dir(model.mcore_path))
            return "model.mcore_path", model.mcore_path
        if starting_weights:
            load_hf_into_trainer(self.trainer, model.hf_path)
            return "model.hf_path", model.hf_path
        return "seed", None

    def _build(self, spec, starting_weights: bool) -> None:
        """The process group, the trainer, its state (resumed or starting), the log, the source."""
        from bapo_megatron.trainer.base_identity import identify_base
        from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel
        from bapo_megatron.trainer.policy_trainer import PolicyTrainer

        cfg = self.cfg
        self.source.prepare()  # (rank 0 of a generating run: the engines start up beside the trainer)
        self.own_group = not dist.is_initialized()
        init_distributed()
        if not torch.cuda.is_available():
            from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

            activate_cpu_shim()
        self.trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        lora = cfg.model.lora.enabled
        if lora:  # the base the adapters train on: loaded and identified on resume too, refused if another
            base = identify_base(self.trainer, *self._load_starting_weights(starting_weights), self.resume_from)
            if self.checkpointer.manager is not None:  # a base with a source is loaded from it: not saved again
                self.checkpointer.manager.without_base = base.path is not None
        start = self.checkpointer.resume(self.trainer) if cfg.checkpoint.resume else None
        self.resumed, self.step = start is not None, start or 0
        self.ending.step = self.step
        if not self.resumed and not lora:
            self._load_starting_weights(starting_weights)
        if not self.resumed:  # the KL loss's reference: the starting weights (a resume loads the run's own)
            self.trainer.hold_reference()
        if self.rank == 0:
            cfg.run_path.mkdir(parents=True, exist_ok=True)
            write_text_atomic(cfg.run_path / "config.yaml", dump_config(cfg))
        quiet.flush(cfg.run_path, rank=self.rank)  # every rank's, tagged (rank 0 made the directory)
        logger = MetricLogger(
            cfg.logging,
            job_name=cfg.name,
            config=to_dict(cfg),
            enabled=self.rank == 0,
            run_dir=cfg.run_path,
            resume_step=self.step if self.resumed else None,
        )
        self.log = StepLog(logger)
        self.source.start(self.trainer, self.step, self.resumed)
        if not self.resumed and (evaluation := self.source.evaluate(0)) is not None:
            self.log.record(0, {}, evaluation)  # the starting policy's held-out score

    def nothing_to_do(self, why: str) -> None:
        """AlreadyFinished: said on rank 0 with the next commands, status.json "finished" (a run that
        failed or was stopped after its last checkpoint is finished all the same). The same command
        run again is idempotent, stop_when's end included."""
        from bapo_megatron.trainer.checkpoint import step_of

        cfg, step = self.cfg, step_of(self.resume_from)
        if self.rank == 0:
            print("\n".join([why, *next_commands(cfg)]), flush=True)
            previous = RunStatus.read(cfg.run_path)
            if previous is None or previous.state != "finished":
                self.ending.begin()  # (its banner is not said: nothing starts)
                self.ending.record(RunStatus("finished", "steps", step, cfg.steps))
        raise AlreadyFinished(why)

    def watch(self, step: int, metrics: dict[str, float]) -> None:
        """A step's metrics, for stop_when; RunStopped (every rank: the figure is theirs too) when
        optimizer.max_skipped_steps steps in a row skipped every update: the run is not training."""
        self.ending.step = step
        self.until.add(metrics)
        skipped_all = metrics.get("train/skipped", 0) >= self.cfg.algo.updates_per_batch
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped_all else 0
        if self.skipped_in_a_row >= self.cfg.optimizer.max_skipped_steps:
            cfg = self.cfg
            raise RunStopped(
                f"the last {self.skipped_in_a_row} steps (to step {step}) skipped every update for a non-finite "
                f"loss or gradient (optimizer.max_skipped_steps={cfg.optimizer.max_skipped_steps}): the run is "
                f"not training. Check optimizer.lr={cfg.optimizer.lr:g}, "
                f"rollout.sampling.temperature={cfg.rollout.sampling.temperature:g} and the data; the warnings "
                "above say what was non-finite, and the last checkpoint is kept"
            )

    def should_stop(self, step: int) -> bool:
        """Whether the run ends at this step boundary (every rank agrees): stop_when or a signal."""
        early, signalled = any_rank(self.ended == "stop_when" or self.until.local(), self.stop.received is not None)
        if early and self.ended is None and self.rank == 0:
            print(f"{self.until.describe()}: the run ends at step {step} of {self.cfg.steps}", flush=True)
        self.ended = "stop_when" if early else "signal" if signalled else None
        return self.ended is not None

    def finish(self, step: int) -> None:
        """The last step's lines and checkpoint; status.json says how the run ended (for job scripts:
        requeue a stopped run, export a finished one)."""
        cfg = self.cfg
        self.log.flush()
        if step > self.step and not self.checkpointer.due(step):  # trained here, and not saved on schedule
            self.checkpointer.save(self.trainer, step, self.log)
        status = RunStatus.ended(step, cfg.steps, self.ended, self.stop.received, cfg.stop_when)
        self.ending.record(status)
        if self.rank == 0:
            if self.stop.received is not None:
                print(self._stopped(step), file=sys.stderr)
            elif status.state == "finished":  # what was written, and what comes next
                manager = self.checkpointer.manager
                saved = manager.root / f"step_{step:08d}" if manager is not None else None
                print(ending(cfg, step, saved if saved is not None and saved.is_dir() else None), flush=True)

    def _stopped(self, step: int) -> str:
        """What a stop signal left: the checkpoint the same command resumes from, or nothing saved."""
        from bapo_megatron.trainer.checkpoint import step_of

        cfg, signum, saved = self.cfg, self.stop.received, self.ending.checkpoint()
        if saved is not None:
            return f"signal {signum}: saved step {step_of(saved)} of {cfg.steps}; the same command resumes"
        return f"signal {signum} at step {step} of {cfg.steps}: nothing was saved; the same command starts over"

    def failed(self, err: BaseException) -> None:
        """status.json says the run failed and why (rank 0); the lines of the steps it trained are
        written, its last checkpoint stays as it was."""
        if self.rank != 0 or self.log is None:
            return
        with contextlib.suppress(Exception):  # the error being reported matters more than these lines
            self.log.flush(evaluations=False)
        self.ending.record(RunStatus.failed(self.log.step or self.step, self.cfg.steps, str(err) or type(err).__name__))

    def close(self) -> None:
        """Teardown: signals restored, engines stopped, logs closed (the warnings held since the start
        too), the process group destroyed."""
        self.stop.restore()
        try:
            self.source.close()
        finally:
            with contextlib.suppress(OSError):  # (a full disk: the run's own error matters more)
                quiet.flush(self.cfg.run_path, rank=self.rank)
            if self.log is not None:
                with contextlib.suppress(Exception):  # an interrupt's: the lines of the steps it trained
                    self.log.flush(evaluations=False)
                self.log.logger.close()
            if self.own_group and dist.is_initialized():
                from bapo_megatron.trainer.parallel import destroy_model_parallel

                destroy_model_parallel()
                dist.destroy_process_group()


@dataclass
class RolloutOnly:
    """`bapo-train CONFIG --rollout-only`: a run's engines, prompts and reward without its trainer
    (verl's trainer.val_only, slime's debug rollout): each step generated by the starting weights,
    scored and written down (rollouts.jsonl, metrics.jsonl), in rollout_only_config's directory.
    No process group, optimizer, checkpoint or weight update; SIGTERM ends it as Ctrl-C does."""

    cfg: JobConfig
    driver: object  # driver.RolloutDriver
    log: MetricLogger
    stop: StopSignal

    @classmethod
    def start(cls, cfg: JobConfig, ending: Ending) -> RolloutOnly:
        from bapo_megatron.driver import RolloutDriver
        from bapo_megatron.trainer.parallel import single_process_env

        single_process_env()
        if (world := int(os.environ["WORLD_SIZE"])) > 1:
            raise ConfigError(
                "WORLD_SIZE", world, "--rollout-only runs in one process: start it without torchrun or srun"
            )
        spec = check_rollout_only(cfg)  # as its dry run checks
        stop = StopSignal(save_on_signal=False)
        driver = None
        try:
            driver = RolloutDriver(cfg, spec, cfg.run_path)  # data, reward, tokenizer, ports checked
            print(rollout_banner(cfg, spec, keep_earlier_logs(cfg)), flush=True)
            ending.begin()
            write_text_atomic(cfg.run_path / "config.yaml", dump_config(cfg))
            driver.start_generating(cfg.model.hf_path)
            logger = MetricLogger(cfg.logging, job_name=cfg.name, config=to_dict(cfg), run_dir=cfg.run_path)
        except BaseException:
            stop.restore()
            if driver is not None:
                driver.close()
            raise
        return cls(cfg, driver, logger, stop)

    def close(self) -> None:
        self.stop.restore()
        try:
            self.driver.close()
        finally:
            self.log.close()
            with contextlib.suppress(OSError):
                quiet.flush(self.cfg.run_path, rank=0)
