"""Where a step's batch comes from and where the step's new weights go: one source a run, on every rank.

    source.start(trainer, step, resumed)           # (online) engines up, serving the trainer's weights
    batch, metrics = source.next_batch(step)       # the batch policy version `step` trains on
    metrics = source.publish(trainer, version)     # (online) the new weights out as `version`, checked
    future = source.evaluate(version)              # (online, rank 0) the held-out run of `version`, if due
    with source.quiesced(): ...                    # the moment a checkpoint is taken
    source.state_dict(); source.close()

- ReplaySource: saved rollout batches (rollout.replay), for debugging the trainer alone;
- SFTSource: supervised batches from data.path (algo.loss: sft);
- OnlineSource: rank 0 of a generating run: the driver's batches, handed to every rank;
- OnlineFollower: every other rank of it: the batch received, its part of each weight sync.

Which one a rank runs is decided once, at set-up (`make_source`): the loop never asks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.config import JobConfig
from bapo_megatron.driver import GIVEN_UP, REFIT  # rank 0's answers, broadcast as they are
from bapo_megatron.errors import BadInputError, ConfigError, RunStopped
from bapo_megatron.fsutil import atomic_directory, remove
from bapo_megatron.logger import truncate_after

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


class BatchSource:
    """A source that generates nothing: no engines to feed, nothing to evaluate, nothing in flight."""

    name = "source"  # its key among the checkpoint's extras
    stopping: Callable[[], bool] = staticmethod(lambda: False)
    """Whether the job has been asked to stop (a signal): a rollout waiting on slow engines or
    rewards gives its step up (job.py sets it)."""

    def start(self, trainer, step: int, resumed: bool) -> None:
        pass

    def next_batch(self, step: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """The step's batch and its figures; (None, {}) when the job is stopping and the step is
        given up before any rank trained on it."""
        raise NotImplementedError

    def publish(self, trainer, version: int) -> dict[str, float]:
        return {}

    def evaluate(self, version: int) -> Future | None:
        return None

    def quiesced(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass


class ReplaySource(BatchSource):
    """Saved rollout batches, one per step, cycling; its cursor is checkpointed. Every file is
    read and checked against the model when the source is made, before any model is built."""

    name = "replay"

    def __init__(self, cfg: JobConfig, spec: ModelSpec) -> None:
        path = cfg.rollout.replay
        root = Path(path)
        self.files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
        if not self.files or not all(f.is_file() for f in self.files):
            raise ConfigError("rollout.replay", path, "no rollout batch (.safetensors) found there")
        for f in self.files:
            try:
                batch = RolloutBatch.load(f)
            except ValueError as err:
                raise BadInputError(str(err)) from None
            problem = batch.problem(spec.vocab_size) or self._unfit(cfg, spec, batch)
            if problem:
                raise BadInputError(f"rollout batch {f}: {problem}")
        self.index = 0

    @staticmethod
    def _unfit(cfg: JobConfig, spec: ModelSpec, batch: RolloutBatch) -> str | None:
        """What of this job's settings the batch does not fit (None: it fits)."""
        groups = len({s.group for s in batch.samples})
        if groups % cfg.algo.updates_per_batch:
            return f"{groups} groups do not split into algo.updates_per_batch={cfg.algo.updates_per_batch} updates"
        longest = max(s.length for s in batch.samples)
        if longest > cfg.parallel.max_tokens_per_microbatch:
            return (
                f"a sample of {longest} tokens exceeds parallel.max_tokens_per_microbatch="
                f"{cfg.parallel.max_tokens_per_microbatch}: a sample must fit one micro-batch"
            )
        if longest > spec.max_position_embeddings:
            return f"a sample of {longest} tokens exceeds the model's context of {spec.max_position_embeddings}"
        return None

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        batch = RolloutBatch.load(self.files[self.index % len(self.files)])
        self.index += 1
        return batch, {}

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


class SFTSource(BatchSource):
    """Supervised batches for `algo.loss: sft`: data.path's records in the PromptSource order, each
    a sample whose response is its answer followed by the tokenizer's end token. The first
    data.check_records records are tokenized and checked against the model's context when the source
    is made, the others when drawn. The cursor is checkpointed. A step takes prompts_per_step x
    samples_per_prompt records."""

    name = "sft"

    def __init__(self, cfg: JobConfig, spec: ModelSpec) -> None:
        from bapo_megatron.data.prompts import Overlong, PromptSource, load_tokenizer

        tokenizer = load_tokenizer(cfg.model.hf_path)
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise ConfigError(
                "model.hf_path", cfg.model.hf_path, "algo.loss=sft needs a tokenizer with an end token there"
            )

        self.tokenizer, self.path, self.answer_field = tokenizer, cfg.data.path, cfg.data.answer_field
        self.positions = spec.max_position_embeddings
        try:
            self.prompts = PromptSource(cfg.data, tokenizer=tokenizer)
            for i in range(self.prompts.checked_ahead):  # what the first steps train on, checked now
                with contextlib.suppress(Overlong):
                    self._answer(*self.prompts.item(i))
        except ValueError as err:
            raise BadInputError(str(err)) from None
        self.per_group = cfg.rollout.samples_per_prompt
        self.size = cfg.rollout.prompts_per_step * self.per_group

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        samples = []
        for i in range(self.size):
            _, ids, meta = self.prompts.next()
            answer = self._answer(ids, meta)
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
        return RolloutBatch(samples=samples), {}

    def _answer(self, ids: list[int], meta: dict) -> list[int]:
        """The record's answer tokens and the end token; BadInputError naming a record without one
        or one that does not fit the model's positions."""
        where = f"{self.path} record {meta['index'] + 1}"
        if "answer" not in meta:
            raise BadInputError(f"{where}: no field {self.answer_field!r} (data.answer_field) to train on")
        answer = [*self.tokenizer.encode(str(meta["answer"]), add_special_tokens=False), self.tokenizer.eos_token_id]
        if len(ids) + len(answer) > self.positions:
            raise BadInputError(
                f"{where}: prompt and answer take {len(ids) + len(answer)} tokens, more than the model's "
                f"{self.positions} positions"
            )
        return answer

    def state_dict(self) -> dict:
        return self.prompts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state)


class OnlineFollower(BatchSource):
    """A rank other than 0 of a generating run: it receives each batch, helps make each weight sync's
    buckets (and, colocated on several GPUs, holds its own copy for the engine on its GPU), and
    scores the probe with the others."""

    name = "rollout"

    driver = None  # rank 0's (OnlineSource)

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.holders = None
        self.trainer = None
        self.refit_gaps: list[float] = []  # probe gaps of refits during the step (reported at its publish)

    def start(self, trainer, step: int, resumed: bool) -> None:
        self.trainer = trainer
        self.holders = handle_holders(self.cfg, trainer)  # a collective: every rank, here
        engine_model_dir(self.cfg, trainer)
        self.publish(trainer, step)

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Rank 0's batch. Meanwhile rank 0 may ask every rank to refit an engine that came back
        (the rollout waits for it: no other engine serves), or say that the run stops."""
        refit: dict[str, float] = {}
        while True:
            batch = _broadcast(None)
            if batch == REFIT:
                refit = self._refit(step)
            elif batch == GIVEN_UP:
                return None, {}
            elif isinstance(batch, str):  # rank 0 stopped the run (a reward that does not work): so do we
                raise RunStopped(batch)
            else:
                return batch, refit

    def _refit(self, version: int) -> dict[str, float]:
        """The current weights (version `version`) to the engines that wait for them, checked; the
        probe's gap is reported with the step's publish (sync/refit_probe_gap, the largest)."""
        start = time.monotonic()
        gap = self._publish(self.trainer, version).get("sync/refit_probe_gap")
        if gap is not None:
            self.refit_gaps.append(gap)
        return {"time/refit": time.monotonic() - start}

    def _refit_gap(self, metrics: dict[str, float]) -> dict[str, float]:
        """`metrics` with the refits' probe gaps since the last publish folded into its own."""
        gaps = self.refit_gaps + ([metrics["sync/refit_probe_gap"]] if "sync/refit_probe_gap" in metrics else [])
        self.refit_gaps = []
        return {**metrics, "sync/refit_probe_gap": max(gaps)} if gaps else metrics

    def publish(self, trainer, version: int) -> dict[str, float]:
        return self._refit_gap(self._publish(trainer, version))

    def _publish(self, trainer, version: int) -> dict[str, float]:
        buckets = weight_buckets(self.cfg, trainer, self.holders)
        if self.holders is not None:
            self.holders.hold(buckets)
        else:
            for _ in buckets:  # this rank's part of the gathers
                pass
        return {**probe_gap(self.cfg, trainer, version, None), **refit_probe(self.cfg, trainer, version, None)}


class OnlineSource(OnlineFollower):
    """Rank 0 of a generating run: the driver's engines, prompts and rewards (rollout/, driver.py)."""

    def __init__(self, cfg: JobConfig, spec: ModelSpec) -> None:
        from bapo_megatron.driver import RolloutDriver

        super().__init__(cfg)
        self.driver = RolloutDriver(cfg, spec, cfg.run_path)  # data, reward, tokenizer, ports, URLs checked
        self._busy: tuple[float, float] | None = None

    def start(self, trainer, step: int, resumed: bool) -> None:
        self.trainer = trainer
        self.holders = handle_holders(self.cfg, trainer)
        model_dir = engine_model_dir(self.cfg, trainer)
        truncate_after(self.cfg.run_path / "samples.jsonl", step if resumed else None)
        self.driver.start(model_dir, self.holders, self._colocated_fraction(trainer))
        self.publish(trainer, step)  # the engines serve the trainer's weights (a resumed run's too)

    def _colocated_fraction(self, trainer) -> float | None:
        e = self.cfg.rollout.engines
        if e.kind != "sglang" or not e.colocate or e.mem_fraction_static is not None:
            return None
        from bapo_megatron.trainer.memory import rollout_mem_fraction

        gpu = torch.cuda.get_device_properties(0).total_memory
        return rollout_mem_fraction(self.cfg, trainer.spec, gpu, trainer.info.dp_size)

    def next_batch(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        refit: dict[str, float] = {}
        while True:
            try:
                got = self.driver.next_batch(step, self.stopping)
            except RunStopped as err:
                _broadcast(str(err))  # the other ranks wait for this batch: they stop too
                raise
            if got == GIVEN_UP:
                _broadcast(GIVEN_UP)
                return None, {}
            if got != REFIT:
                break
            _broadcast(REFIT)  # every rank helps send the weights to the engine that came back
            refit = self._refit(step)
        batch, metrics = got
        _broadcast(batch)
        return batch, {**metrics, **refit}

    def _publish(self, trainer, version: int) -> dict[str, float]:
        metrics = self.driver.publish(weight_buckets(self.cfg, trainer, self.holders), version)
        metrics.update(probe_gap(self.cfg, trainer, version, self.driver))
        metrics.update(refit_probe(self.cfg, trainer, version, self.driver))
        metrics.update(self._engine_share())
        return metrics

    def _engine_share(self) -> dict[str, float]:
        """engine/idle_share: the share of the engines' time since the last publish in which they held
        no request of ours (or were paused): the engines waiting for the trainer."""
        pool = self.driver.strategy.pool
        now, busy = time.monotonic(), pool.busy_seconds()
        last, self._busy = self._busy, (now, busy)
        if last is None or now <= last[0]:
            return {}
        return {"engine/idle_share": 1.0 - (busy - last[1]) / (len(pool) * (now - last[0]))}

    def evaluate(self, version: int) -> Future | None:
        return self.driver.evaluate(version)

    def quiesced(self) -> contextlib.AbstractContextManager:
        return self.driver.quiesced()

    def state_dict(self) -> dict:
        return self.driver.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.driver.load_state_dict(state)

    def close(self) -> None:
        self.driver.close()


def make_source(cfg: JobConfig, spec: ModelSpec, rank: int) -> BatchSource:
    """This rank's source, everything it reads checked (before any process group or model)."""
    if cfg.rollout.replay is not None:
        return ReplaySource(cfg, spec)
    if cfg.algo.loss == "sft":
        return SFTSource(cfg, spec)
    return OnlineSource(cfg, spec) if rank == 0 else OnlineFollower(cfg)


# ----------------------------------------------------------------------------------------------
# The weights' way out, on every rank.


def handle_holders(cfg: JobConfig, trainer):
    """weights/sync.HandleHolders when engines the driver starts are colocated on several GPUs
    (each engine rank then loads the copy of the trainer rank on its GPU); else None: rank 0's
    copy serves every engine rank (one engine GPU, or pipeline stages, which only rank 0 joins)."""
    from bapo_megatron.weights.sync import HandleHolders

    e = cfg.rollout.engines
    n = e.servers * e.tensor_parallel
    if not e.colocate or e.urls or trainer.info.pp_size > 1 or not 1 < n <= dist.get_world_size():
        return None
    try:
        return HandleHolders(n)
    except ValueError as err:
        raise ConfigError("rollout.engines.colocate", e.colocate, str(err)) from None


def weight_buckets(cfg: JobConfig, trainer, holders):
    """The model's HF buckets as this rank makes them for a sync: on rank 0 the whole model (every
    data-parallel rank 0 helping gather it); with holders, every holder its own copy."""
    from bapo_megatron.weights.export import stream_hf_buckets
    from bapo_megatron.weights.gather import hf_buckets_to_rank0

    size = cfg.rollout.sync.bucket_mb << 20
    if holders is None:
        return hf_buckets_to_rank0(trainer, size)
    # the tensor-parallel groups with a holder make the buckets; the others wait
    mine = min(dist.get_process_group_ranks(trainer.info.tp_group)) < holders.n
    return stream_hf_buckets(trainer.model, trainer.spec, trainer.info, size) if mine else iter(())


def refit_probe(cfg: JobConfig, trainer, version: int, driver) -> dict[str, float]:
    """Engines that came back took the weights in this publish: with rollout.sync.check_every, each
    must answer the probe within the bound (all ranks together) before it serves again."""
    if not cfg.rollout.sync.check_every:
        if driver is not None:
            driver.revive(driver.refit)
        return {}
    engines = _broadcast(driver.refit if driver is not None else None)
    if not engines:
        return {}
    gaps = [probe_gap(cfg, trainer, version, driver, engine).get("sync/probe_logprob_gap") for engine in engines]
    if driver is not None:
        driver.revive([e for e, gap in zip(engines, gaps, strict=True) if gap is not None])
    gaps = [gap for gap in gaps if gap is not None]
    return {"sync/refit_probe_gap": max(gaps)} if gaps else {}


def probe_gap(cfg: JobConfig, trainer, version: int, driver, engine: int | None = None) -> dict[str, float]:
    """Every rollout.sync.check_every versions (for engine `engine`: now), all ranks together: the
    engine's log-probs of a fixed response (rank 0's driver asks for it) against the trainer's;
    RunStopped beyond the bound."""
    every = cfg.rollout.sync.check_every
    if not every or (engine is None and version % every):
        return {}
    probe = _broadcast(driver.probe(engine) if driver is not None else None)
    if probe is None:  # no engine to probe answered (each is restarted and probed after its refit)
        return {}
    copies = 2 * trainer.info.dp_size  # every data-parallel rank scores a copy; a group of >= 2
    batch = RolloutBatch(
        samples=[dataclasses.replace(probe) for _ in range(copies)], temperature=cfg.rollout.sampling.temperature
    )
    gap = trainer.logprob_gap(batch)
    if gap > cfg.rollout.sync.check_max_gap:
        raise RunStopped(
            f"weight sync check: the engines' log-probs of the probe differ from the trainer's by {gap:.3g} "
            f"(> rollout.sync.check_max_gap={cfg.rollout.sync.check_max_gap}) after the sync of version "
            f"{version}: the engines are not serving the trainer's weights; stopping rather than training on them"
        )
    return {"sync/probe_logprob_gap": gap}


def engine_model_dir(cfg: JobConfig, trainer) -> Path | None:
    """A directory the engines can start from (rank 0; None elsewhere): model.hf_path when it has
    weights (whatever they are: the first sync sends the trainer's, a resumed run's included), else
    the trainer's weights written once to the run directory's engine_model/ (every data-parallel
    rank 0 helping gather them; a random or mcore_path start of a model without HF weights)."""
    from safetensors.torch import save_file

    from bapo_megatron.weights.gather import hf_buckets_to_rank0

    if cfg.model.hf_path and any(Path(cfg.model.hf_path).glob("*.safetensors")):
        return Path(cfg.model.hf_path) if dist.get_rank() == 0 else None
    tensors = {name: t.cpu() for bucket in hf_buckets_to_rank0(trainer, 512 << 20) for name, t in bucket}
    if dist.get_rank() != 0:
        return None
    target = cfg.run_path / "engine_model"
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


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _broadcast(obj=None):
    """Rank 0's object on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_device())
    return box[0]
