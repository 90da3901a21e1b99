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

What rank 0 hands the others is a typed message (handoff.py); the weights' way out, the same on
every rank but for where the buckets go, is weights/publish.py.

Which one a rank runs is decided once, at set-up (`make_source`): the loop never asks.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.config import JobConfig
from bapo_megatron.engines.fleet import node_engines
from bapo_megatron.errors import BadInputError, ConfigError, RunStopped
from bapo_megatron.handoff import GiveUp, Handoff, Ready, Refit, Stop
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.weights.publish import Gathering, WeightPublisher, broadcast, engine_model_dir, handle_holders


class BatchSource:
    """A source that generates nothing: no engines to feed, nothing to evaluate, nothing in flight."""

    name = "source"  # its key among the checkpoint's extras
    stopping: Callable[[], bool] = staticmethod(lambda: False)
    """Whether the job has been asked to stop (a signal): a rollout waiting on slow engines or
    rewards gives its step up (job.py sets it)."""

    def prepare(self) -> None:
        """Before the trainer is built: what can start without it (its start-up overlaps the trainer's)."""

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
            problem = batch.problem(spec) or self._unfit(cfg, spec, batch)
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
            from bapo_megatron.data.prompts import missing_field

            fields = {k: v for k, v in meta.items() if k != "index"}
            why = missing_field(fields, self.answer_field, "data.answer_field", "to train on")
            raise BadInputError(f"{where}: {why}")
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
    """A rank other than 0 of a generating run: it receives each batch (handoff.py), helps make each
    weight sync's buckets (and, colocated on several GPUs, holds its own copy for the engine on its
    GPU), and scores the probes with the others (weights/publish.py)."""

    name = "rollout"

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.publisher: WeightPublisher | None = None
        self.refit_gaps: list[float] = []  # probe gaps of refits during the step (reported at its publish)
        self.node_servers: list = []  # colocated engines this rank started for its node (engines/fleet.node_engines)

    def start(self, trainer, step: int, resumed: bool) -> None:
        holders = handle_holders(self.cfg, trainer)  # a collective: every rank, here
        engine_model_dir(self.cfg, trainer)
        self.node_servers = node_engines(self.cfg, trainer.spec, holders, None, None, None)  # (colocated, a node's)
        self.publisher = WeightPublisher(self.cfg, trainer, Gathering(holders), holders)
        self.publish(trainer, step)

    def next_batch(self, step: int) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Rank 0's batch. Meanwhile rank 0 may ask every rank to refit an engine that came back
        (the rollout waits for it: no other engine serves), or say that the run stops."""
        refit: dict[str, float] = {}
        while True:
            message = self._receive(step)
            match message:
                case Ready(batch, metrics):
                    return batch, {**metrics, **refit}
                case Refit():
                    refit = self._refit(step)
                case GiveUp():
                    return None, {}
                case Stop(reason):  # rank 0 stopped the run (a reward that does not work): so do we
                    raise RunStopped(reason)

    def _receive(self, step: int) -> Handoff:
        return broadcast(None)

    def _refit(self, version: int) -> dict[str, float]:
        """The current weights (version `version`) to the engines that wait for them, checked; the
        probe's gap is reported with the step's publish (sync/refit_probe_gap, the largest)."""
        start = time.monotonic()
        gap = self.publisher.publish(version).get("sync/refit_probe_gap")
        if gap is not None:
            self.refit_gaps.append(gap)
        return {"time/refit": time.monotonic() - start}

    def publish(self, trainer, version: int) -> dict[str, float]:
        """The new weights out as `version`, checked; the refits' probe gaps since the last publish
        folded into its own."""
        metrics = self.publisher.publish(version)
        gaps = self.refit_gaps + ([metrics["sync/refit_probe_gap"]] if "sync/refit_probe_gap" in metrics else [])
        self.refit_gaps = []
        return {**metrics, "sync/refit_probe_gap": max(gaps)} if gaps else metrics

    def close(self) -> None:
        for server in self.node_servers:
            server.stop()


class OnlineSource(OnlineFollower):
    """Rank 0 of a generating run: the driver's engines, prompts and rewards (driver.py, rollout/);
    the engines' weight-update group (weights/engine_updates.py) is this rank's outlet of each publish."""

    def __init__(self, cfg: JobConfig, spec: ModelSpec) -> None:
        from bapo_megatron.driver import RolloutDriver

        super().__init__(cfg)
        self.driver = RolloutDriver(cfg, spec, cfg.run_path)  # data, reward, tokenizer, ports, URLs checked

    def prepare(self) -> None:
        """The engines launched on model.hf_path's weights while the trainer is built, when that is
        what they start from and nothing of the trainer decides how (a colocated SGLang server's
        memory fraction is the trainer's estimate): they take the trainer's weights at the first
        publish whatever they start from."""
        e, hf = self.cfg.rollout.engines, self.cfg.model.hf_path
        needs_trainer = e.kind == "sglang" and e.colocate and e.mem_fraction_static is None
        if hf and any(Path(hf).glob("*.safetensors")) and not needs_trainer:
            self.driver.launch(hf)

    def start(self, trainer, step: int, resumed: bool) -> None:
        holders = handle_holders(self.cfg, trainer)
        model_dir = engine_model_dir(self.cfg, trainer)
        self.driver.records.truncate_after(step if resumed else None)  # one timeline with metrics.jsonl
        fraction = self._colocated_fraction(trainer)
        node_engines(self.cfg, trainer.spec, holders, self.driver.engines, model_dir, fraction)  # the other nodes'
        self.driver.start(model_dir, holders, fraction)
        self.publisher = WeightPublisher(self.cfg, trainer, self.driver.updates, holders)
        self.publish(trainer, step)  # the engines serve the trainer's weights (a resumed run's too)

    def _colocated_fraction(self, trainer) -> float | None:
        e = self.cfg.rollout.engines
        if e.kind != "sglang" or not e.colocate or e.mem_fraction_static is not None:
            return None
        from bapo_megatron.trainer.memory.estimate import rollout_mem_fraction

        gpu = torch.cuda.get_device_properties(0).total_memory
        return rollout_mem_fraction(self.cfg, trainer.spec, gpu, trainer.info.dp_size)

    def _receive(self, step: int) -> Handoff:
        """The driver's answer, handed to every rank (a run the driver stops stops everywhere)."""
        try:
            message = self.driver.next_batch(step, self.stopping)
        except RunStopped as err:
            broadcast(Stop(str(err)))  # the other ranks wait for this batch: they stop too
            raise
        broadcast(Ready(message.batch) if isinstance(message, Ready) else message)  # the figures are rank 0's
        return message

    def evaluate(self, version: int) -> Future | None:
        return self.driver.evaluate(version, self.stopping)

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
