"""The BAPO training driver: generate, reward, train, sync the weights, log, checkpoint.

    bapo-train CONFIG.yaml key=value ...                                # one process (CPU)
    torchrun --nproc-per-node 8 -m bapo_megatron.train CONFIG.yaml ...  # a parallel job
    bapo-train --help-config; bapo-train CONFIG.yaml --dry-run          # every field; what would run

One step (`run`): rank 0 drives the engines (driver.py) until rollout.prompts_per_step
prompt groups are complete and rewarded (partial rollout, oversampling, staleness), hands the
batch to every rank, the trainer takes algo.updates_per_batch optimizer steps on it, and the
new weights go to the engines as the next policy version. Saved batches (rollout.replay) are
a second source, for debugging the trainer without generation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.model_spec import ModelSpec, check_layout, tiny_spec
from bapo_megatron.config import JobConfig, dump_config, load_config, to_dict
from bapo_megatron.errors import BadInputError, ConfigError, RunStopped
from bapo_megatron.fsutil import write_text_atomic
from bapo_megatron.logger import MetricLogger, truncate_after


class ReplaySource:
    """Saved rollout batches, one per step, cycling; its cursor is checkpointed. Every file is
    read and checked against the model when the source is made, before any model is built."""

    def __init__(self, path: str, vocab_size: int) -> None:
        root = Path(path)
        self.files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not self.files or not all(f.is_file() for f in self.files):
            raise ConfigError("rollout.replay", path, "no rollout batch (.safetensors) found there")
        for f in self.files:
            try:
                problem = RolloutBatch.load(f).problem(vocab_size)
            except ValueError as err:
                raise BadInputError(str(err)) from None
            if problem:
                raise BadInputError(f"rollout batch {f}: {problem}")
        self.index = 0

    def next_batch(self) -> RolloutBatch:
        batch = RolloutBatch.load(self.files[self.index % len(self.files)])
        self.index += 1
        return batch

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


class SFTSource:
    """Supervised batches for `algo.loss: sft`: data.path's records in the PromptSource order, each
    a sample whose response is its answer followed by the tokenizer's end token. Every record is
    tokenized and checked against the model's context when the source is made. The cursor is
    checkpointed. A step takes prompts_per_step x samples_per_prompt records."""

    def __init__(self, cfg: JobConfig, spec: ModelSpec) -> None:
        from bapo_megatron.driver import load_tokenizer
        from bapo_megatron.rollout.data import PromptSource

        tokenizer = load_tokenizer(cfg.model.hf_path)
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ConfigError(
                "model.hf_path", cfg.model.hf_path, "algo.loss=sft needs a tokenizer with an end token there"
            )

        def tokenize(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        try:
            self.prompts = PromptSource(cfg.data, tokenize)
        except ValueError as err:
            raise BadInputError(str(err)) from None
        self.answers: dict[int, list[int]] = {}
        for ids, meta in self.prompts.items:
            where = f"{cfg.data.path} record {meta['index'] + 1}"
            if "answer" not in meta:
                raise BadInputError(f"{where}: no field {cfg.data.answer_field!r} (data.answer_field) to train on")
            answer = [*tokenize(str(meta["answer"])), tokenizer.eos_token_id]
            if len(ids) + len(answer) > spec.max_position_embeddings:
                raise BadInputError(
                    f"{where}: prompt and answer take {len(ids) + len(answer)} tokens, more than the model's "
                    f"{spec.max_position_embeddings} positions"
                )
            self.answers[meta["index"]] = answer
        self.per_group = cfg.rollout.samples_per_prompt
        self.size = cfg.rollout.prompts_per_step * self.per_group

    def next_batch(self) -> RolloutBatch:
        samples = []
        for i in range(self.size):
            _, ids, meta = self.prompts.next()
            answer = self.answers[meta["index"]]
            samples.append(
                Sample(
                    prompt_ids=ids,
                    response_ids=list(answer),
                    behaviour_logprobs=[0.0] * len(answer),
                    versions=[0] * len(answer),
                    reward=0.0,
                    group=i // self.per_group,
                )
            )
        return RolloutBatch(samples=samples)

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


def model_spec(cfg: JobConfig) -> ModelSpec:
    return ModelSpec.from_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else tiny_spec()


def validate(cfg: JobConfig, spec: ModelSpec, world_size: int) -> None:
    """Every check that needs no process group, so bad input fails before expensive work starts."""
    from bapo_megatron.trainer.megatron_config import check_precision_support

    check_layout(spec, cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.virtual_pipeline)
    dp = cfg.parallel.data_parallel_size(world_size)
    per_update = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // cfg.algo.updates_per_batch
    if per_update % dp:
        raise ConfigError(
            "rollout.prompts_per_step",
            cfg.rollout.prompts_per_step,
            f"{per_update} samples per optimizer step do not split over {dp} data-parallel ranks",
        )
    if cfg.parallel.virtual_pipeline and per_update // dp < cfg.parallel.pipeline:
        raise ConfigError(
            "rollout.prompts_per_step",
            cfg.rollout.prompts_per_step,
            f"{per_update // dp} samples per data-parallel rank and optimizer step cannot fill the interleaved "
            f"schedule's groups of {cfg.parallel.pipeline} micro-batches (parallel.virtual_pipeline)",
        )
    check_precision_support(cfg.model)


def check_starting_weights(cfg: JobConfig, spec: ModelSpec) -> bool:
    """Whether model.hf_path's safetensors are the starting weights; their files (or mcore_path's)
    checked before any model is built. A config without weights: random ones, loudly."""
    import warnings

    from bapo_megatron.common.hf_io import HFCheckpoint
    from bapo_megatron.trainer.checkpoint import weights_dir
    from bapo_megatron.trainer.integrity import verify

    if cfg.model.mcore_path:
        verify(weights_dir(cfg.model.mcore_path), check_contents=False)
        return False
    if not cfg.model.hf_path:
        return False
    if not any(Path(cfg.model.hf_path).glob("*.safetensors")):
        warnings.warn(
            f"model.hf_path={cfg.model.hf_path} has a config.json but no *.safetensors: training starts from "
            "RANDOM weights (set model.mcore_path, or put the model's safetensors there)",
            stacklevel=2,
        )
        return False
    try:
        HFCheckpoint(cfg.model.hf_path)  # shapes against config.json, every tensor accounted for
    except ValueError as err:
        raise BadInputError(str(err)) from None
    return True


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


class StopSignal:
    """SIGTERM/SIGUSR1 (checkpoint.save_on_signal): remembered, acted on at the next step boundary
    (all ranks agree, then save and exit 0). Without save_on_signal, SIGTERM ends the run at once,
    through its teardown (engines stopped), and SIGUSR1 is ignored."""

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
            raise SystemExit(128 + signum)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StopWhen:
    """`stop_when`: whether the mean of a metric over its last stop_window values (one an optimizer
    step) has crossed a value. Only ranks that compute the metric (the last pipeline stage) can
    decide (`local`); the loop tells every rank with one collective, together with the signal."""

    def __init__(self, rule: str | None, window: int) -> None:
        from collections import deque

        from bapo_megatron.config import parse_stop_when

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


def _any_rank(*flags: bool) -> list[bool]:
    """Whether each flag is true on any rank: one all-reduce, every rank calling it at the same point."""
    import torch

    t = torch.tensor([float(f) for f in flags], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def stopped_early_at(run_dir: Path, rule: str | None) -> int | None:
    """The step at which this run's stop_when ended it (status.json), if the same rule did."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return None
    return status.get("step") if status.get("reason") == "stop_when" and status.get("stop_when") == rule else None


class _NoState:
    """The driver's state on ranks other than 0 (rank 0 saves it; the others have none to restore)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _broadcast(obj=None):
    """rank 0's object on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_device())
    return box[0]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def engine_model_dir(cfg: JobConfig, trainer, run_dir: Path) -> Path | None:
    """A directory the engines can start from: model.hf_path when it has weights (whatever they are:
    the first sync sends the trainer's, a resumed run's included), else the trainer's weights
    written once to run_dir/engine_model (on rank 0, every data-parallel rank 0 helping gather
    them; a random or mcore_path start of a model without HF weights)."""
    from bapo_megatron.weights.gather import hf_buckets_to_rank0

    if cfg.model.hf_path and any(Path(cfg.model.hf_path).glob("*.safetensors")):
        return Path(cfg.model.hf_path)
    tensors = {name: t.cpu() for bucket in hf_buckets_to_rank0(trainer, 512 << 20) for name, t in bucket}
    if dist.get_rank() != 0:
        return None
    import json
    import shutil

    from safetensors.torch import save_file

    from bapo_megatron.fsutil import atomic_directory, remove

    target = run_dir / "engine_model"
    if target.exists():
        remove(target)  # this run's own, from an earlier start
    with atomic_directory(target) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(trainer.spec.to_hf_config(), indent=1))
        if cfg.model.hf_path:
            for name in TOKENIZER_FILES:
                if (Path(cfg.model.hf_path) / name).is_file():
                    shutil.copy(Path(cfg.model.hf_path) / name, tmp / name)
    return target


def run(cfg: JobConfig) -> list[dict[str, float]]:
    """Train for cfg.steps steps (resuming from cfg.checkpoint.dir when it holds one). Every check
    that needs no model runs first: bad input fails in seconds, before any process group starts."""
    import torch

    from bapo_megatron.driver import RolloutDriver, write_samples_log
    from bapo_megatron.trainer.checkpoint import CheckpointManager, weights_dir
    from bapo_megatron.trainer.integrity import verify
    from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel, single_process_env
    from bapo_megatron.trainer.policy_trainer import PolicyTrainer
    from bapo_megatron.weights.hf_load import load_hf_into_trainer

    spec = model_spec(cfg)
    single_process_env()
    validate(cfg, spec, int(os.environ["WORLD_SIZE"]))
    rank, run_dir = int(os.environ["RANK"]), cfg.run_path
    sft = cfg.algo.loss == "sft"
    if sft and cfg.rollout.replay is not None:
        raise ConfigError("rollout.replay", cfg.rollout.replay, "algo.loss=sft trains on data.path; unset one")
    online = cfg.rollout.replay is None and not sft
    if cfg.rollout.replay is not None:
        source = ReplaySource(cfg.rollout.replay, spec.vocab_size)
    else:
        source = SFTSource(cfg, spec) if sft else None
    own_group = not dist.is_initialized()
    stop = StopSignal(cfg.checkpoint.save_on_signal)
    driver = logger = None
    history: list[dict[str, float]] = []
    try:
        if online and rank == 0:
            driver = RolloutDriver(cfg, spec, run_dir)  # data, reward, tokenizer, ports, engine URLs checked
        starting_weights = check_starting_weights(cfg, spec)
        ckpt = CheckpointManager(cfg.checkpoint, dump_config(cfg)) if cfg.checkpoint.dir else None
        if ckpt is not None:  # before any process group or model: a wrong start fails in seconds
            ckpt.check_start(cfg.checkpoint.resume)
            resume_from = ckpt.latest() if cfg.checkpoint.resume else None
            if resume_from is not None:
                verify(resume_from, check_contents=False)
        init_distributed()
        if not torch.cuda.is_available():
            from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

            activate_cpu_shim()
        trainer = PolicyTrainer(spec, cfg, init_model_parallel(cfg.parallel, cfg.seed))
        if ckpt is not None:
            name = "sft" if sft else "replay" if source else "rollout"
            ckpt.register(name, source or driver or _NoState())
        start = ckpt.load(trainer) if ckpt and cfg.checkpoint.resume else None
        resumed = start is not None
        if not resumed:  # a new run: its starting weights
            start = 0
            if cfg.model.mcore_path:
                trainer.load_weights(weights_dir(cfg.model.mcore_path))
            elif starting_weights:
                load_hf_into_trainer(trainer, cfg.model.hf_path)
        if rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
        logger = MetricLogger(
            cfg.logging,
            job_name=cfg.name,
            config=to_dict(cfg),
            enabled=rank == 0,
            run_dir=run_dir,
            resume_step=trainer.step if resumed else None,
        )
        holders = handle_holders(cfg, trainer) if online else None  # a collective: every rank, here
        if online:
            model_dir = engine_model_dir(cfg, trainer, run_dir)
            if driver is not None:
                truncate_after(run_dir / "samples.jsonl", start if resumed else None)
                driver.start(model_dir, holders)
                driver.engine_stats()  # the engines' busy time counts from here
            sync_weights(cfg, trainer, driver, start, holders)  # the engines serve the checkpoint's weights
            if driver is not None and not resumed and cfg.eval.path:  # the starting policy's score
                logger.log(trainer.step, driver.evaluate())
        step, until = start, StopWhen(cfg.stop_when, cfg.stop_window)
        # a run that stop_when ended, started again: it stays ended (the same command is idempotent)
        ended = until.rule is not None and resumed and stopped_early_at(run_dir, cfg.stop_when) == start
        early, signalled = _any_rank(ended, stop.received is not None)
        while step < cfg.steps and not early and not signalled:
            t0 = time.monotonic()
            if online:
                batch, rollout_stats = driver.rollout(step) if driver else (None, {})
                if driver:
                    driver.release_memory()
                batch = _broadcast(batch)
            else:
                batch, rollout_stats = source.next_batch(), {}
            t1 = time.monotonic()
            for k, part in enumerate(split_groups(batch, cfg.algo.updates_per_batch)):
                metrics = {**(rollout_stats if k == 0 else {}), **trainer.train_step(part, first_update=k == 0).metrics}
                until.add(metrics)
                if k < cfg.algo.updates_per_batch - 1:  # the step's last update is logged with its timings
                    history.append(metrics)
                    logger.log(trainer.step, metrics)
            t2 = time.monotonic()
            step += 1
            metrics.update(sync_weights(cfg, trainer, driver, step, holders) if online else {})
            if driver is not None and ((cfg.eval.interval and step % cfg.eval.interval == 0) or step == cfg.steps):
                metrics.update(driver.evaluate())
            if ckpt is not None and cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0:
                metrics["time/checkpoint"] = save(ckpt, trainer, driver, step)
            elapsed = time.monotonic() - t0
            metrics.update(
                {
                    "time/rollout": t1 - t0,
                    "time/train": t2 - t1,
                    "time/step": elapsed,
                    "perf/tokens_per_s": sum(s.length for s in batch.samples) / max(elapsed, 1e-9),
                    "perf/samples_per_s": len(batch) / max(elapsed, 1e-9),
                    "driver/step": float(step),
                }
            )
            if driver is not None:
                metrics.update(driver.engine_stats())
                write_samples_log(run_dir / "samples.jsonl", step, batch)
            history.append(metrics)
            logger.log(trainer.step, metrics)
            early, signalled = _any_rank(until.local(), stop.received is not None)
            if early and rank == 0:
                print(f"{until.describe()}: the run ends at step {step} of {cfg.steps}", flush=True)
        if ckpt and step > start and (not cfg.checkpoint.interval or step % cfg.checkpoint.interval):
            save(ckpt, trainer, driver, step)
        if rank == 0:  # for job scripts: requeue a stopped run (slurm/*.sh), export a finished one
            state = "finished" if step >= cfg.steps or early else "stopped"
            reason = "steps" if step >= cfg.steps else "stop_when" if early else "signal"
            status = {"state": state, "reason": reason, "step": step, "steps": cfg.steps, "signal": stop.received}
            if early:
                status["stop_when"] = cfg.stop_when
            write_text_atomic(run_dir / "status.json", json.dumps(status) + "\n")
        if stop.received is not None and rank == 0:
            print(
                f"signal {stop.received}: saved step {step} of {cfg.steps}; the same command resumes", file=sys.stderr
            )
    finally:
        stop.restore()
        if driver is not None:
            driver.close()
        if logger is not None:
            logger.close()
        if own_group and dist.is_initialized():
            from bapo_megatron.trainer.parallel import destroy_model_parallel

            destroy_model_parallel()
            dist.destroy_process_group()
    return history


def handle_holders(cfg: JobConfig, trainer):
    """weights/sync.HandleHolders when engines the driver starts are colocated on several GPUs
    (each engine rank then loads the copy of the trainer rank on its GPU); else None: rank 0's
    copy serves every engine rank (one engine GPU, or pipeline stages, which only rank 0 joins)."""
    from bapo_megatron.weights.sync import HandleHolders

    ro = cfg.rollout
    n = ro.servers * ro.tensor_parallel
    if not ro.colocate or ro.engine_urls or trainer.info.pp_size > 1 or not 1 < n <= dist.get_world_size():
        return None
    try:
        return HandleHolders(n)
    except ValueError as err:
        raise ConfigError("rollout.colocate", ro.colocate, str(err)) from None


def sync_weights(cfg: JobConfig, trainer, driver, version: int, holders=None) -> dict[str, float]:
    """The trainer's weights to the engines as policy `version` (rank 0 sends, every data-parallel rank
    0 helps gather; with `holders`, every rank makes its own copy and ranks 0..n-1 hand theirs to
    the colocated engine ranks on their GPUs); every rollout.sync_check_every versions, the probe:
    the engine's log-probs of a fixed response against the trainer's, all ranks together."""
    from bapo_megatron.weights.export import stream_hf_buckets
    from bapo_megatron.weights.gather import hf_buckets_to_rank0

    size = cfg.rollout.sync_bucket_mb << 20
    if holders is not None:  # the tensor-parallel groups with a holder make the buckets; others wait
        mine = min(dist.get_process_group_ranks(trainer.info.tp_group)) < holders.n
        buckets = stream_hf_buckets(trainer.model, trainer.spec, trainer.info, size) if mine else iter(())
    else:
        buckets = hf_buckets_to_rank0(trainer, size)
    metrics = {}
    if driver is not None:
        metrics = driver.sync(buckets, version)
    elif holders is not None:
        holders.hold(buckets)
    else:
        for _ in buckets:
            pass
    every = cfg.rollout.sync_check_every
    if every and version % every == 0:
        probe = _broadcast(driver.probe() if driver else None)
        copies = 2 * trainer.info.dp_size  # every data-parallel rank scores a copy; a group of >= 2
        samples = [dataclasses.replace(probe) for _ in range(copies)]
        batch = RolloutBatch(samples=samples, temperature=cfg.rollout.temperature)
        gap = trainer.logprob_gap(batch)
        metrics["sync/probe_logprob_gap"] = gap
        if gap > cfg.rollout.sync_check_max_gap:
            raise RunStopped(
                f"weight sync check: the engines' log-probs of the probe differ from the trainer's by {gap:.3g} "
                f"(> rollout.sync_check_max_gap={cfg.rollout.sync_check_max_gap}) after the sync of version "
                f"{version}: the engines are not serving the trainer's weights; stopping rather than training on them"
            )
    return metrics


def save(ckpt, trainer, driver, step: int) -> float:
    """A whole-run checkpoint of driver step `step` (retract mode: the engines drained first); its seconds."""
    start = time.monotonic()
    if driver is not None:
        driver.drain(step)
    ckpt.save(trainer, step)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> None:
    """`bapo-train` (and python -m bapo_megatron.train): see bapo_megatron/cli.py for the options."""
    from bapo_megatron import cli

    args = cli.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.help_config:
        print(cli.help_config())
        return
    try:
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            print(cli.dry_run(cfg, cli.world_size(args), int(args.gpu_memory_gib * cli.GIB), args.gpus_per_node))
            return
        run(cfg)  # run validates before any process group starts
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


if __name__ == "__main__":
    main()
