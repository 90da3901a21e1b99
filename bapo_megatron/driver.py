"""Rank 0's side of the online loop: the engines, the prompts, the rewards, the weight sync, evaluation.

    driver = RolloutDriver(cfg, spec, run_dir)      # data, reward, tokenizer, ports, engine URLs checked
    driver.start(model_dir)                         # engines started (or connected) and ready
    answer = driver.next_batch(version)             # Ready(batch, metrics), Refit() or GiveUp() (handoff.py)
    metrics = driver.publish(buckets, version)      # every engine now serves `version`
    future = driver.evaluate(version)               # held-out figures of `version`, beside rollout
    driver.close()                                  # engines stopped, workers closed

The rollout runs on the engines' event loop, on a thread of its own (engines/loop.py), so that in
asynchronous mode it goes on while the trainer trains; this thread keeps torch's collectives
(the buckets of a weight sync) and blocks only where it waits for a batch or an answer. How
generation is scheduled is the rollout strategy's (rollout/strategies.py, by rollout.mode,
partial.mode and deterministic). Weights travel over a weight-update group from rank 0, or by
handle to colocated engines, whose memory is released while the trainer runs; after every sync
each engine's weight version is checked against the trainer's (weights/engine_updates.py). The
driver is rank 0's outlet of weights/publish.py: that publish probes and revives through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.common.progress import Progress, bars_on
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.common.routes import recorded_routes
from bapo_megatron.config import JobConfig
from bapo_megatron.engines.client import EngineUnavailable
from bapo_megatron.engines.fleet import Engines
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.supervisor import Supervisor
from bapo_megatron.handoff import GiveUp, Ready, Refit
from bapo_megatron.logger import RolloutLog
from bapo_megatron.rewards.workers import FailingRewards, RewardWorkers
from bapo_megatron.rollout.buffer import GroupState, RolloutBuffer
from bapo_megatron.rollout.core import RolloutCore
from bapo_megatron.rollout.evaluation import HeldOut
from bapo_megatron.rollout.filtering import DropEqualRewards, KeepAll
from bapo_megatron.rollout.inputs import RolloutInputs
from bapo_megatron.rollout.strategies import AbortSteps, AsyncStream, DeterministicRounds, RetractSteps, Strategy

PROBE_TOKENS = 16


def make_strategy(cfg: JobConfig, core: RolloutCore) -> Strategy:
    """The rollout mode's strategy."""
    ro = cfg.rollout
    sieve = DropEqualRewards(ro.filter_groups.max_extra_rounds) if ro.filter_groups.enabled else KeepAll()
    if ro.mode == "async":
        return AsyncStream(core, ro.prompts_per_step, ro.oversample, ro.pause_mode, sieve)
    if ro.deterministic:
        return DeterministicRounds(core, ro.prompts_per_step, ro.oversample, sieve)
    if ro.partial.enabled and ro.partial.mode == "retract":
        return RetractSteps(core, ro.prompts_per_step, ro.oversample, sieve)
    return AbortSteps(core, ro.prompts_per_step, ro.oversample, keep=ro.partial.enabled, filter_groups=sieve)


class RolloutDriver:
    def __init__(self, cfg: JobConfig, spec: ModelSpec, run_dir: Path) -> None:
        """Everything that can be checked without an engine or a model, checked: the data sets, the
        reward and the tokenizer (rollout/inputs.py), the engines' ports or URLs."""
        from bapo_megatron.trainer.parallel import local_world_size

        ro = cfg.rollout
        self.cfg, self.spec, self.run_dir = cfg, spec, Path(run_dir)
        self.inputs = RolloutInputs(cfg, spec)
        self.prompts = self.inputs.prompts
        self.buffer = RolloutBuffer(
            ro.samples_per_prompt,
            ro.sampling.max_new_tokens,
            ro.token_budget,
            ro.max_staleness,
            ro.mask_stale_prefix,
            routes=recorded_routes(cfg, spec),
        )
        self.progress = bars_on(cfg.logging.progress)
        self.loop = EngineLoop()
        try:
            self.engines = Engines(cfg, spec, self.run_dir, self.loop, local_world_size())
        except BaseException:
            self.loop.close()
            raise
        self.rewards = RewardWorkers.from_config(cfg.reward, self.inputs.reward)  # processes start at the first score
        self.failing_rewards = FailingRewards.from_config(cfg.reward)
        slots = ro.engines.max_batch * max(1, len(ro.engines.urls) or ro.engines.servers)
        decode = self.inputs.decode
        texts = decode if self.inputs.tokenizer is not None else None  # else rollouts.jsonl holds token ids
        self.rollout_log = RolloutLog(self.run_dir / "rollouts.jsonl", cfg.logging.samples, texts)
        self.held_out = HeldOut(self.inputs.eval_sets, cfg.eval, ro.sampling, cfg.seed, self.rewards, decode, slots)
        self.strategy: Strategy | None = None
        self.updates = None  # weights/engine_updates.EngineUpdates, once the engines are up
        self.supervisor: Supervisor | None = None
        self._batch: Future | None = None  # a step's rollout, across a refit
        self._evaluation: Future | None = None  # the held-out run in progress
        self._busy: tuple[float, float] | None = None  # (time, the engines' busy seconds) at the last publish

    # ------------------------------------------------------------------------------------------
    # Engines.

    def launch(self, model_dir: str | Path) -> None:
        """Start the engine processes on `model_dir` now, without waiting for them: `start` waits,
        so their start-up overlaps the trainer's."""
        self.engines.launch(model_dir)

    def start(self, model_dir: str | Path, holders=None, colocated_fraction: float | None = None) -> None:
        """Start the engines on `model_dir` (or connect to rollout.engines.urls) and wait until every
        one answers; then the rollout strategy and the weight-update group (colocated on several
        GPUs, `holders`: weights/sync.HandleHolders)."""
        from bapo_megatron.weights.engine_updates import EngineUpdates

        ro = self.cfg.rollout
        pool = self.engines.start(model_dir, colocated_fraction)
        s = ro.sampling
        core = RolloutCore(
            pool,
            self.buffer,
            self.prompts.next,
            self.rewards,
            SamplingParams(s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
            decode=self.inputs.decode,
            deterministic_seed=self.cfg.seed if ro.deterministic else None,
        )
        self.strategy = make_strategy(self.cfg, core)
        self.updates = EngineUpdates(ro, self.engines, holders)
        e = ro.engines  # colocated engines share the trainer's GPUs: one that dies stops the run
        self.supervisor = Supervisor(pool, self.engines.servers, e.max_restarts, e.startup_timeout_s, not e.colocate)
        self.loop.run(self.supervisor.start())

    # ------------------------------------------------------------------------------------------
    # One step.

    def needs_refit(self) -> bool:
        """No engine serves and one waits for the weights (brought back after a death): the step
        cannot go on until every rank helps send them (sources.OnlineFollower.next_batch)."""
        pool = self.engines.pool
        return bool(pool.refitting) and not pool.live()

    def next_batch(self, version: int, stopping=lambda: False) -> Ready | Refit | GiveUp:
        """Ready: the next prompts_per_step complete groups, for policy version `version` to train
        on, and their figures; Refit: the rollout waits for an engine that needs the weights (the
        step's rollout goes on where it was at the next call); GiveUp: `stopping()` (a signal) came
        first: the run ends without this step, from the state of its last checkpoint or its last
        step. Colocated engines then give their memory to the trainer until the sync."""
        ro = self.cfg.rollout
        core = self.strategy.core
        with Progress(ro.prompts_per_step, f"rollout {version}", unit="group", enabled=self.progress) as bar:
            wanted = ro.prompts_per_step

            def progress(groups: int, tokens: int) -> None:
                bar.reach(min(groups, wanted), f"{tokens:,} tokens")

            core.on_progress = progress
            try:
                if self._batch is None:
                    self._batch = self.loop.submit(self.strategy.batch(version))
                while not self._batch.done():
                    if stopping():  # a signal: no step waits for slow engines or rewards, nor for a refit
                        self._batch.cancel()
                        self._batch.unwound.wait(60)
                        self._batch = None
                        return GiveUp()
                    if self.needs_refit():  # no engine serves; one waits for the weights
                        return Refit()
                    with contextlib.suppress(TimeoutError):
                        self.loop.wait(self._batch, timeout=0.2)
                batch, self._batch = self._batch, None
                groups, stats = batch.result()
            finally:
                core.on_progress = None
        checked = self.failing_rewards.check(groups, version + 1)  # before the step trains on it
        batch = RolloutBatch.from_groups(
            groups,
            ro.sampling.temperature,
            metadata={"version": str(version)},
            loss_masks=[[self.buffer.loss_mask(s, version) for s in g.samples] for g in groups],
            routes=self.buffer.routes,
        )
        with (self.run_dir / "samples.jsonl").open("a") as f:  # which prompt groups the step trains on
            f.write(json.dumps({"step": version + 1, "groups": [g.uid for g in groups]}) + "\n")
        self.rollout_log.write(version + 1, groups, self.buffer.oldest_allowed(version))
        if self.cfg.logging.save_batches:  # the trainer's half alone, later: rollout.replay=<run_dir>/batches
            (self.run_dir / "batches").mkdir(exist_ok=True)
            batch.save(self.run_dir / "batches" / f"step_{version + 1:08d}.safetensors")
        self.updates.release_memory()
        figures = {**stats, **checked, **batch_figures(groups, version, ro.sampling.max_new_tokens, self.buffer)}
        if self.cfg.data.max_prompt_tokens is not None:
            figures["data/prompts_dropped"] = float(self.prompts.dropped)  # so far, this run and before
        return Ready(batch, figures)

    def publish(self, buckets: Iterable, version: int) -> dict[str, float]:
        """Every bucket to every engine as weight version `version` (the engines paused as the mode
        wants meanwhile); each engine's version is then checked. An evaluation still running on the
        weights these replace finishes first."""
        self.wait_evaluation()
        start, pool = time.monotonic(), self.engines.pool
        flush = not (self.cfg.rollout.mode == "async" and self.cfg.rollout.pause_mode == "in_place")
        with self.loop.context(self.strategy.paused(version)):
            sent = self.updates.send(buckets, version, flush)
        self.updates.check(version)
        return {
            "time/weight_sync": time.monotonic() - start,
            "sync/bytes": float(sent),
            "engine/live": len(pool.live()),
            "engine/restarts": float(self.supervisor.restarts),
            **self._idle_share(),
        }

    def _idle_share(self) -> dict[str, float]:
        """engine/idle_share: the share of the engines' time since the last publish in which they held
        no request of ours (or were paused): the engines waiting for the trainer."""
        pool = self.engines.pool
        now, busy = time.monotonic(), pool.busy_seconds()
        last, self._busy = self._busy, (now, busy)
        if last is None or now <= last[0]:
            return {}
        return {"engine/idle_share": 1.0 - (busy - last[1]) / (len(pool) * (now - last[0]))}

    def waiting(self) -> list[int]:
        """The engines the last publish sent the weights to while they waited for them."""
        return self.updates.waiting

    def revive(self, engines: list[int]) -> None:
        """These engines took the current weights and passed the checks: they serve again."""
        self.updates.revive(engines)

    def probe(self, engine: int | None = None) -> Sample | None:
        """A fixed response (the first prompt, sampled with a fixed seed) with the log-probs of
        engine `engine` (default: a live one). None: no such engine answered (one that did not is
        marked dead: it is restarted, and probed again after its refit)."""
        ((ids, _),) = self.prompts.first(1)
        sampling = SamplingParams(
            max_new_tokens=min(PROBE_TOKENS, self.cfg.rollout.sampling.max_new_tokens),
            temperature=self.cfg.rollout.sampling.temperature,
            ignore_eos=True,
            sampling_seed=self.cfg.seed,
        )
        pool = self.engines.pool
        for index in pool.live() if engine is None else [engine]:
            try:
                completion = self.loop.run(
                    self.engines.clients[index].generate(list(ids), sampling, f"probe-{secrets.token_hex(4)}")
                )
            except EngineUnavailable:
                self.loop.call(pool.mark_dead, index)
                continue
            break
        else:
            return None
        return Sample(
            prompt_ids=list(ids),
            response_ids=completion.output_ids,
            behaviour_logprobs=completion.logprobs,
            versions=[0] * len(completion.output_ids),
            reward=0.0,
            group=0,
        )

    def evaluate(self, version: int, stopping=lambda: False) -> Future | None:
        """Start the held-out evaluation of the weights the engines serve (version `version`) when
        eval.* says it is due; it runs beside rollout, and the next publish waits for it. Given up,
        with no figures, when `stopping()` (a signal) comes while no engine serves: its requests
        would wait for engines that are gone, and the run's last line and checkpoint must not."""
        if not self.held_out.due(version, self.cfg.steps):
            return None
        self.wait_evaluation()
        self._evaluation = self.loop.submit(self._evaluate(version, stopping))
        return self._evaluation

    async def _evaluate(self, version: int, stopping) -> dict[str, float]:
        run = asyncio.ensure_future(self.held_out.run(self.engines.pool, version))
        while not run.done():
            if stopping() and not self.engines.pool.live():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
                print(f"the held-out evaluation of version {version} is given up: the run is stopping", flush=True)
                return {}
            await asyncio.wait([run], timeout=0.2)
        return run.result()

    def wait_evaluation(self) -> None:
        if self._evaluation is not None:
            self.loop.wait(self._evaluation)
            self._evaluation = None

    @contextlib.contextmanager
    def quiesced(self):
        """Nothing in flight meanwhile (requests aborted, their output kept; every reward in): the
        state a checkpoint holds. Generation goes on afterwards."""
        self.wait_evaluation()
        self.loop.run(self.strategy.drain())
        try:
            yield
        finally:
            self.loop.run(self.strategy.resume())

    # ------------------------------------------------------------------------------------------
    # The run's state and the end.

    def state_dict(self) -> dict[str, Any]:
        async def snapshot() -> dict[str, Any]:  # on the loop, where the state changes
            return {
                "buffer": self.buffer.state_dict(),
                "prompts": self.prompts.state_dict(),
                "rewards": {**self.rewards.state_dict(), **self.failing_rewards.state_dict()},
            }

        return self.loop.run(snapshot())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        self.prompts.load_state_dict(state["prompts"])
        self.rewards.load_state_dict(state["rewards"])
        self.failing_rewards.load_state_dict(state["rewards"])

    def close(self) -> None:
        """Stop what this driver started; safe to call more than once and after a failed start."""
        if self.loop.closed:
            return
        try:
            if self.supervisor is not None:
                self.loop.run(self.supervisor.close(), timeout=30)
            if self.strategy is not None:
                self.loop.run(self.strategy.close(), timeout=30)
            self.loop.cancel_all(30)  # requests of a step cut short (an error, Ctrl-C): before their clients close
            if self.updates is not None:
                self.updates.close()
        except Exception:  # the engines may be gone already: their end of the group is gone too
            pass
        finally:
            self.updates = None
            self.engines.close()
            self.rewards.close()
            self.loop.close()


def batch_figures(groups: list[GroupState], version: int, max_new_tokens: int, buffer: RolloutBuffer) -> dict:
    """What the groups a step trains on look like: reward, length, truncation, and how stale their
    tokens are for policy version `version` (mean, max, the share at each staleness, the share
    masked out as older than the bound)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples]
    lengths = [len(s.response_ids) for s in samples]
    stale = [version - v for s in samples for v in s.versions]
    out = {
        "rollout/reward_mean": sum(rewards) / len(rewards),
        "rollout/response_length": sum(lengths) / len(lengths),
        "rollout/truncated": sum(n >= max_new_tokens for n in lengths) / len(lengths),
        "rollout/token_staleness_mean": sum(stale) / max(1, len(stale)),
        "rollout/token_staleness_max": float(max(stale, default=0)),
        "rollout/stale_masked_share": sum(k > buffer.max_staleness for k in stale) / max(1, len(stale)),
    }
    for k in range(max(stale, default=0) + 1):
        out[f"rollout/staleness_share/{k}"] = stale.count(k) / len(stale)
    return out
