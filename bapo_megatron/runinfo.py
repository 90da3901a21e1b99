"""What a run says about itself: the identity its checkpoints record, its start banner, its end lines, its status.

    record = identity(cfg, spec)                       # each step directory's run.json
    notice = check_resume(step_dir, record, allowed)   # ConfigError for another run's checkpoint
    print(banner(cfg, spec, world, resume_from))       # rank 0, before the engines and the trainer start
    print(ending(cfg, step, saved))                    # rank 0, after the last step
    kept = keep_earlier_logs(cfg)                      # a run that starts over: the earlier logs set aside
    with Ending(cfg) as ending: ...                    # status.json however the run ends, for job scripts

A checkpoint is this run's when it records the same run name and the same algo, data, reward and
model shape (SAME_RUN): the parallel layout, the step count, the optimizer, the engines and the
evaluation may change on resume (the trainer reshards; more steps extend the run).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal as signals
import sys
from pathlib import Path
from typing import Literal

from bapo_megatron.config import JobConfig, dotted, to_dict
from bapo_megatron.errors import ConfigError
from bapo_megatron.fsutil import write_text_atomic
from bapo_megatron.models.spec import ModelSpec, spec_fields
from bapo_megatron.plan import layout
from bapo_megatron.trainer.checkpoint import CheckpointManager, run_record, step_of

SAME_RUN = ("algo", "data", "reward")
"""The config sections a resumed run shares with the run that saved its checkpoint (with the model's shape)."""
MECHANICS = {
    "data.cache_dir",
    "data.check_records",
    "reward.workers",
    "reward.timeout_s",
    "reward.memory_mb",
    "reward.max_failure_share",
    "reward.failure_steps",
}
"""Fields of those sections that change how the run computes, not what it trains on or for."""
SHOWN = 4  # differences named in a refusal
STATUS = "status.json"
"""How the run ended (RunStatus), in its run directory."""
EARLIER = "previous"
"""The run directory's folder of the logs of earlier starts that started over (keep_earlier_logs)."""
LOGS = ("samples.jsonl", "rollouts.jsonl", "batches", "tensorboard", STATUS)
"""What a run writes in its run directory beside metrics.jsonl, and a new start would cut back, hide
or mix with its own (tensorboard/: logging.backends' events, unless logging.tensorboard_dir moves them)."""


def identity(cfg: JobConfig, spec: ModelSpec) -> dict:
    """The run's name, its SAME_RUN fields (dotted, as run.json holds them) and their fingerprint."""
    fields = {}
    for section in SAME_RUN:
        fields.update(dotted(to_dict(getattr(cfg, section)), section))
    fields.update({f"model.{key}": value for key, value in spec_fields(spec).items()})  # as the converter reads them
    fields = json.loads(json.dumps({k: v for k, v in fields.items() if k not in MECHANICS}))  # tuples as lists
    fingerprint = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {"name": cfg.name, "fingerprint": fingerprint, "config": fields}


def differences(recorded: dict, mine: dict) -> list[str]:
    """How the run that saved a checkpoint differs from this one: its name, then each field both
    know (a field one of them does not have came or went with a version of this package)."""
    out = []
    if recorded.get("name") != mine["name"]:
        out.append(f"run name {recorded.get('name')!r}, this run {mine['name']!r}")
    theirs = recorded.get("config")
    if recorded.get("fingerprint") != mine["fingerprint"] and isinstance(theirs, dict):
        ours = mine["config"]
        shared = sorted(theirs.keys() & ours.keys())
        out += [f"{k}={theirs[k]!r}, this run {ours[k]!r}" for k in shared if theirs[k] != ours[k]]
    return out


def check_resume(directory: Path, mine: dict, allow_foreign: bool) -> str | None:
    """None when the step directory a run would resume was saved by this run; a one-line notice when
    it records no run (saved before checkpoints did) or another run that checkpoint.allow_foreign
    accepts; ConfigError naming what differs otherwise."""
    recorded = run_record(directory)
    if recorded is None:
        return f"checkpoint {directory} does not record which run saved it (saved before run.json): resuming it"
    found = differences(recorded, mine)
    if not found:
        return None
    said = "; ".join(found[:SHOWN]) + (f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else "")
    if allow_foreign:
        return f"resuming {directory}, saved by another run ({said}): checkpoint.allow_foreign=true"
    raise ConfigError(
        "checkpoint.dir",
        str(directory.parent),
        f"holds step {step_of(directory)} of another run ({said}). Give this run its own checkpoint.dir (by "
        f"default its run directory's ckpt/), start it from those weights with model.mcore_path={directory}, or "
        "resume that run's checkpoint anyway with checkpoint.allow_foreign=true",
    )


def parameters(spec: ModelSpec) -> int:
    from bapo_megatron.trainer.memory.estimate import stage_params

    return stage_params(spec, spec.vocab_size, 1, 1, 0)


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _model(cfg: JobConfig, spec: ModelSpec) -> str:
    shape = f"{spec.architecture}, {spec.num_layers} layers, hidden {spec.hidden_size}"
    if spec.moe is not None:
        shape += f", {spec.moe.num_experts} experts top-{spec.moe.top_k}"
    where = cfg.model.hf_path or "the built-in tiny model"
    return f"{where} ({shape}), {_count(parameters(spec))} parameters, {cfg.model.precision}"


def _start(cfg: JobConfig, resume_from: Path | None, starting_weights: bool) -> str:
    if resume_from is not None:
        return f"resumed from {resume_from}, step {step_of(resume_from)} of {cfg.steps}"
    return f"starting from {_origin(cfg, starting_weights)}"


def _origin(cfg: JobConfig, starting_weights: bool) -> str:
    """The weights a run that does not resume starts from."""
    if cfg.model.mcore_path:
        return f"the weights of {cfg.model.mcore_path}"
    return f"{cfg.model.hf_path}'s weights" if starting_weights else "random weights"


def _plural(n: int, noun: str, suffix: str = "s") -> str:
    return f"{n} {noun}{suffix if n != 1 else ''}"


def _address(host: str, first: int | None, count: int) -> str:
    """Where `count` servers listen: host:port(s), or on a free port each (first None)."""
    if first is None:
        return f"a free port of {host}" if count == 1 else f"a free port each of {host}"
    return f"{host}:{first}" if count == 1 else f"{host}:{first}-{first + count - 1}"


def _chat_template(cfg: JobConfig) -> list[tuple[str, str]]:
    """The banner's row on how prompts meet the model's chat template (data.chat_template_kwargs
    among them: Qwen3's enable_thinking); none without prompts to render or a model directory's template."""
    d = cfg.data
    if d.path is None or cfg.rollout.replay is not None or cfg.model.hf_path is None:
        return []
    text = "chat-message and text prompts (data.chat_template)" if d.chat_template else "chat-message prompts"
    return [("chat template", f"the model's, {d.template_options()}; for {text}")]


def _batches(cfg: JobConfig) -> str:
    ro, run = cfg.rollout, cfg.run_path
    if ro.replay is not None:
        return f"replayed from {ro.replay} (no engines)"
    if cfg.algo.loss == "sft":
        return f"supervised, from {cfg.data.path} (no engines)"
    e = ro.engines
    prompts = f"prompts from {cfg.data.path}; "
    if e.urls:
        return prompts + f"{_plural(len(e.urls), 'running engine')} at {', '.join(e.urls)}"
    if e.kind == "embedded":
        return prompts + (
            f"{_plural(e.servers, 'embedded engine')} on {_address('127.0.0.1', e.first_port, e.servers)}, "
            f"logs {run}/engine_*.log"
        )
    return prompts + (
        f"{_plural(e.servers, 'SGLang server')} x TP {e.tensor_parallel} on "
        f"{_address(e.host, e.first_port, e.servers)}, "
        f"logs {run}/sglang_*.log"
    )


def metrics_path(cfg: JobConfig) -> Path | None:
    if "jsonl" not in cfg.logging.backends:
        return None
    return Path(cfg.logging.jsonl_path) if cfg.logging.jsonl_path else cfg.run_path / "metrics.jsonl"


def _records(cfg: JobConfig) -> str:
    names = ["config.yaml", STATUS, "warnings.log"]
    metrics = metrics_path(cfg)
    if metrics is not None:
        names.insert(1, metrics.name if metrics.parent == cfg.run_path else str(metrics))
    if cfg.rollout.replay is None and cfg.algo.loss != "sft":
        names.append("samples.jsonl")
        if cfg.logging.samples:
            names.append(f"rollouts.jsonl ({cfg.logging.samples} samples a step)")
    if "wandb" in cfg.logging.backends:
        names.append(f"wandb project {cfg.logging.wandb_project}")
    if "tensorboard" in cfg.logging.backends:
        names.append(f"tensorboard events in {cfg.logging.tensorboard_dir or 'tensorboard/'}")
    return ", ".join(names)


def _checkpoints(cfg: JobConfig) -> str:
    c, path = cfg.checkpoint, cfg.checkpoint_path
    if path is None:
        return "nothing will be saved (checkpoint.save=false)"
    when = f"every {c.interval} steps and at the end" if c.interval else "at the end"
    return f"{path}, {when}, the newest {c.keep_last} kept"


def banner(
    cfg: JobConfig,
    spec: ModelSpec,
    world: int,
    resume_from: Path | None,
    starting_weights: bool = False,
    kept: Path | None = None,
) -> str:
    """What the run is about to do, said before anything slow starts; kept: where the logs of an
    earlier start of a run that starts over went (keep_earlier_logs)."""
    rows = [
        ("run directory", str(cfg.run_path)),
        ("model", _model(cfg, spec)),
        ("start", _start(cfg, resume_from, starting_weights)),
        ("batches", _batches(cfg)),
        *_chat_template(cfg),
        ("records", _records(cfg)),
        ("checkpoints", _checkpoints(cfg)),
    ]
    if kept is not None:
        rows.append(("earlier logs", f"kept in {kept} (an earlier start's: this one starts over)"))
    processes = f"{_plural(world, 'process', 'es')}, {layout(cfg.parallel, world)}"
    head = f"bapo-train {cfg.name}: {cfg.steps} steps, algo.loss={cfg.algo.loss}, {processes}"
    return "\n".join([head, *(f"  {name:<15}{text}" for name, text in rows)])


def rollout_banner(cfg: JobConfig, spec: ModelSpec, kept: Path | None) -> str:
    """What a --rollout-only run is about to do (job.RolloutOnly), said before the engines start."""
    urls = cfg.rollout.engines.urls
    weights = f"the weights the engines at {', '.join(urls)} serve" if urls else f"{cfg.model.hf_path}'s weights"
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    rows = [
        ("run directory", str(cfg.run_path)),
        ("model", f"{_model(cfg, spec)}; {weights} throughout (nothing trains)"),
        ("batches", _batches(cfg)),
        *_chat_template(cfg),
        ("records", f"metrics.jsonl (reward, lengths), rollouts.jsonl (all {per_step} samples a step), {STATUS}"),
    ]
    if kept is not None:
        rows.append(("earlier logs", f"kept in {kept}"))
    head = f"bapo-train {cfg.name} --rollout-only: {cfg.steps} steps generated and scored; no trainer, nothing saved"
    return "\n".join([head, *(f"  {name:<15}{text}" for name, text in rows)])


def next_commands(cfg: JobConfig) -> list[str]:
    """Export, evaluate and plot this run, with its paths."""
    run, ckpt = cfg.run_path, cfg.checkpoint_path
    metrics = metrics_path(cfg)
    lines = []
    if ckpt is not None:
        hf = run / "hf"
        heldout = cfg.eval.path or "HELDOUT.jsonl"
        lines += [
            f"  export:   python tools/convert_checkpoint.py mcore-to-hf --mcore {ckpt} --out {hf}",
            f"  evaluate: python -m bapo_megatron.evaluate {hf} {heldout} --config {run / 'config.yaml'}",
        ]
    if metrics is not None:
        lines.append(f"  plot:     python tools/plot_run.py {run if metrics.parent == run else metrics}")
    return ["next:", *lines] if lines else []


def ending(cfg: JobConfig, step: int, saved: Path | None, how: str = "finished") -> str:
    """The run's last lines: where it ended, what it wrote, and the commands that come next."""
    written = [f"checkpoint {saved}" if saved is not None else "no checkpoint (checkpoint.save=false)"]
    metrics = metrics_path(cfg)
    if metrics is not None:
        written.append(f"metrics {metrics}")
    if cfg.rollout.replay is None and cfg.algo.loss != "sft" and cfg.logging.samples:
        written.append(f"rollouts {cfg.run_path / 'rollouts.jsonl'}")
    return "\n".join([f"{how} at step {step} of {cfg.steps}: {', '.join(written)}", *next_commands(cfg)])


@dataclasses.dataclass(frozen=True)
class RunStatus:
    """How a run ended, as its run directory's status.json says it: for job scripts (slurm/common.sh
    requeues a "stopped" run, exports a "finished" one, fails on anything else) and for the run
    itself (a resume of a run that its stop_when ended has nothing to do)."""

    state: Literal["finished", "stopped", "failed", "interrupted"]
    reason: Literal["steps", "stop_when", "signal", "error"]
    """What ended it: its last step, its stop_when rule, a signal (stopped: saved, the same command
    resumes; interrupted: Ctrl-C, or SIGTERM without checkpoint.save_on_signal, nothing saved then), an error."""
    step: int
    """The last step it trained."""
    steps: int
    """The steps it was to train (cfg.steps)."""
    signal: int | None = None
    """The stop signal it received (None: none)."""
    stop_when: str | None = None
    """The rule that ended it (reason "stop_when")."""
    error: str | None = None
    """What failed (state "failed")."""
    checkpoint: int | None = None
    """The step of the checkpoint the same command resumes from (state "interrupted"; None: none,
    it starts over)."""

    @classmethod
    def ended(
        cls,
        step: int,
        steps: int,
        stopped_by: Literal["stop_when", "signal"] | None,
        signal: int | None,
        rule: str | None,
    ) -> RunStatus:
        """A run that left its loop after `step`: finished at its last step or by its stop_when `rule`,
        else stopped by a signal."""
        if step >= steps:
            return cls("finished", "steps", step, steps, signal)
        if stopped_by == "stop_when":
            return cls("finished", "stop_when", step, steps, signal, stop_when=rule)
        return cls("stopped", "signal", step, steps, signal)

    @classmethod
    def failed(cls, step: int, steps: int, error: str) -> RunStatus:
        return cls("failed", "error", step, steps, error=error)

    @classmethod
    def interrupted(cls, step: int, steps: int, signal: int, checkpoint: int | None) -> RunStatus:
        return cls("interrupted", "signal", step, steps, signal, checkpoint=checkpoint)

    def write(self, run_dir: Path) -> None:
        """run_dir/status.json, whole or not at all: `signal` always (null: none came), `checkpoint`
        always when interrupted (null: none), `stop_when` and `error` where they apply."""
        always = ("signal", "checkpoint") if self.state == "interrupted" else ("signal",)
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in always}
        write_text_atomic(run_dir / STATUS, json.dumps(fields) + "\n")

    @classmethod
    def read(cls, run_dir: Path) -> RunStatus | None:
        """What run_dir/status.json says; None without one, or with one this version cannot read (the
        run's own record, rewritten when it ends again)."""
        try:
            data = json.loads((run_dir / STATUS).read_text())
            return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        except (OSError, ValueError, TypeError):
            return None


class Interrupted(SystemExit):
    """A signal that ends the run at once, through its teardown: Ctrl-C's SIGINT, or SIGTERM
    without checkpoint.save_on_signal; the exit code is the shell's, 128 + the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


class Ending:
    """However a run ends, the one place that records it: status.json on rank 0 (RunStatus), and,
    after an interrupt, one line on what was saved and what the same command will do. It holds the
    whole run (train.run), so that an error or an interrupt while the run starts, trains or stops is
    recorded as well as its own end:

        with Ending(cfg) as ending:
            ending.begin()               # the banner said: the run directory is this run's from here
            ending.step = step           # the last step trained, kept current by the job
            ending.record(status)        # a run that ended its loop, or had nothing to do

    Before `begin` (a check that refuses the config), status.json is written only over an earlier
    one: a stale "stopped" would have a job script requeue the run forever; a mistyped command
    creates nothing."""

    def __init__(self, cfg: JobConfig, rollout_only: bool = False) -> None:
        self.cfg, self.rollout_only = cfg, rollout_only
        self.step = 0
        self.begun = False
        self.status: RunStatus | None = None

    def begin(self) -> None:
        self.begun = True

    def record(self, status: RunStatus) -> None:
        self.status = status
        if int(os.environ.get("RANK", "0")) != 0 or not (self.begun or (self.cfg.run_path / STATUS).is_file()):
            return
        try:
            self.cfg.run_path.mkdir(parents=True, exist_ok=True)
            status.write(self.cfg.run_path)
        except OSError as err:  # (a full disk: the run's own error line still says how it ended)
            print(f"warning: {self.cfg.run_path / STATUS} not written: {err}", file=sys.stderr)

    def __enter__(self) -> Ending:
        return self

    def __exit__(self, kind, err, trace) -> None:
        if isinstance(err, KeyboardInterrupt | Interrupted):
            signum = err.signum if isinstance(err, Interrupted) else signals.SIGINT
            saved = None if self.rollout_only else self.checkpoint()
            self.record(RunStatus.interrupted(self.step, self.cfg.steps, signum, step_of(saved) if saved else None))
            if int(os.environ.get("RANK", "0")) == 0:
                print(interrupted(self.cfg, self.step, saved, self.rollout_only), file=sys.stderr, flush=True)
            raise Interrupted(signum) from None  # said: the command line's handler only exits
        if isinstance(err, Exception) and (self.status is None or self.status.state != "failed"):
            self.record(RunStatus.failed(self.step, self.cfg.steps, str(err) or type(err).__name__))

    def checkpoint(self) -> Path | None:
        """The step directory the same command would resume from (None: none)."""
        path = self.cfg.checkpoint_path
        if path is None or not path.is_dir():
            return None
        try:
            return CheckpointManager(dataclasses.replace(self.cfg.checkpoint, dir=str(path))).latest()
        except ValueError:  # a pointer the next start reports
            return None


def interrupted(cfg: JobConfig, step: int, saved: Path | None, rollout_only: bool = False) -> str:
    """What an interrupted run leaves, and what the same command will do with it."""
    run = cfg.run_path
    engines = cfg.rollout.replay is None and cfg.algo.loss != "sft"
    head = f"interrupted at step {step} of {cfg.steps}" + (", engines stopped" if engines else "")
    again = f"the same command starts over (the logs in {run} are then kept in {run / EARLIER}/)"
    if rollout_only:
        return f"{head}: the rollouts of the steps done are in {run}; {again}"
    if saved is not None and not cfg.checkpoint.resume:
        return f"{head}: {saved} is kept; the same command refuses to start over it (checkpoint.resume=false)"
    if saved is not None:
        done = step_of(saved)
        again = f"step {step}" if step == done + 1 else f"steps {done + 1}-{step}"
        redo = f"; {again} trained again, their lines cut from the logs" if step > done else ""
        return f"{head}: the same command resumes from step {done} ({saved}){redo}; run directory {run}"
    c = cfg.checkpoint
    if cfg.checkpoint_path is None:
        why = "checkpoint.save=false"
    elif c.interval and step < c.interval:
        why = f"the first checkpoint comes at step {c.interval}"
    else:
        why = "checkpoint.interval=0: a checkpoint only at the end"
    starting_weights = bool(cfg.model.hf_path) and any(Path(cfg.model.hf_path).glob("*.safetensors"))
    return (
        f"{head}: nothing was saved ({why}); the same command starts over from "
        f"{_origin(cfg, starting_weights)}, in {run} (this start's logs then kept in {run / EARLIER}/)"
    )


def keep_earlier_logs(cfg: JobConfig) -> Path | None:
    """A run that starts over where an earlier start left logs (interrupted before its first
    checkpoint, or run again with checkpoint.save=false): those logs moved, whole, to the run
    directory's previous/<n> (n: 1, 2, ... the first free), where a new start would cut them back
    to nothing. Returns that folder; None when there was nothing to keep. (A resumed run instead
    cuts its logs back to its checkpoint's step: one timeline.)"""
    run = cfg.run_path
    metrics = metrics_path(cfg)
    found = [p for p in [*([metrics] if metrics else []), *(run / name for name in LOGS)] if p.exists()]
    if not any(p.is_file() and p.suffix == ".jsonl" and p.stat().st_size for p in found):
        return None
    n = 1
    while (run / EARLIER / str(n)).exists():
        n += 1
    kept = run / EARLIER / str(n)
    kept.mkdir(parents=True)
    for path in found:
        shutil.move(path, kept / path.name)  # (logging.jsonl_path may lie on another file system)
    return kept
