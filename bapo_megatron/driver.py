"""Rank 0's side of the online loop, wired: the engines, the prompts, the rewards, the weight sync, evaluation.

    driver = RolloutDriver(cfg, spec, run_dir)      # data, reward, tokenizer, ports, engine URLs checked
    driver.start(model_dir)                         # engines started (or connected) and ready
    answer = driver.next_batch(version)             # Ready(batch, metrics), Refit() or GiveUp() (handoff.py)
    figures = driver.rollout_step(step)             # --rollout-only (after start_generating): no trainer
    future = driver.evaluate(version)               # held-out figures of `version`, beside rollout
    with driver.quiesced(): ...                     # nothing in flight: the state a checkpoint holds
    driver.close()                                  # engines stopped, workers closed

Each concern is a part of its own that the driver builds and joins: the checked inputs
(rollout/inputs.py); the buffer, which turns the groups a step takes into its batch and figures
(rollout/buffer.py); how generation is scheduled (rollout/strategies.py, the one the config asks
for: rollout/modes.py); the held-out runs (rollout/evaluation.py); what each step trains on,
written down (logger.StepRecords); and rank 0's weight outlet, `driver.updates`
(weights/engine_updates.py), through which weights/publish.py sends, probes and revives: weights
travel over a weight-update group from rank 0, or by handle to colocated engines, whose memory is
released while the trainer runs, and each engine's version is checked after every sync.

The rollout runs on the engines' event loop, on a thread of its own (engines/loop.py), so that in
asynchronous mode it goes on while the trainer trains; this thread keeps torch's collectives
(the buckets of a weight sync) and blocks only where it waits for a batch or an answer.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from bapo_megatron.common.progress import Progress, bars_on
from bapo_megatron.common.routes import recorded_routes
from bapo_megatron.config import JobConfig
from bapo_megatron.engines.fleet import Engines
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.supervisor import Supervisor
from bapo_megatron.errors import RunStopped
from bapo_megatron.handoff import GiveUp, Ready, Refit
from bapo_megatron.logger import StepRecords
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.rewards.workers import FailingRewards, RewardWorkers
from bapo_megatron.rollout.adapters import ServedAdapter
from bapo_megatron.rollout.buffer import GroupState, RolloutBuffer
from bapo_megatron.rollout.evaluation import HeldOut, HeldOutRuns
from bapo_megatron.rollout.inputs import RolloutInputs
from bapo_megatron.rollout.modes import make_strategy, rollout_core
from bapo_megatron.rollout.strategies import Strategy


class RolloutDriver:
    def __init__(self, cfg: JobConfig, spec: ModelSpec, run_dir: Path) -> None:
        """Everything that can be checked without an engine or a model, checked: the data sets, the
        reward and the tokenizer (rollout/inputs.py), the engines' ports or URLs."""
        from bapo_megatron.trainer.parallel import local_world_size

        ro = cfg.rollout
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.inputs = RolloutInputs(cfg, spec)
        self.prompts = self.inputs.prompts
        self.buffer = RolloutBuffer.from_config(ro, recorded_routes(cfg, spec))
        self.loop = EngineLoop()
        try:
            self.engines = Engines(cfg, spec, self.run_dir, self.loop, local_world_size())
        except BaseException:
            self.loop.close()
            raise
        self.rewards = RewardWorkers.from_config(cfg.reward, self.inputs.reward)  # processes start at the first score
        self.failing_rewards = FailingRewards.from_config(cfg.reward)
        decode = self.inputs.decode
        self.records = StepRecords(self.run_dir, cfg.logging, decode if self.inputs.tokenizer is not None else None)
        slots = ro.engines.max_batch * max(1, len(ro.engines.urls) or ro.engines.servers)
        # the LoRA adapter every request names (model.lora.sync adapter: the weight sync loads one a version)
        self.adapters = ServedAdapter()
        held_out = HeldOut(
            self.inputs.eval_sets, cfg.eval, ro.sampling, cfg.seed, self.rewards, decode, slots, self.adapters
        )
        self.evaluations = HeldOutRuns(held_out, self.loop, cfg.steps)
        self.progress = bars_on(cfg.logging.progress)
        self.strategy: Strategy | None = None
        self.supervisor: Supervisor | None = None
        self.updates = None  # weights/engine_updates.EngineUpdates (rank 0's weight outlet), once the engines are up
        self._batch: Future | None = None  # a step's rollout, across a refit

    # ------------------------------------------------------------------------------------------
    # Engines.

    def launch(self, model_dir: str | Path) -> None:
        """Start the engine processes on `model_dir` now, without waiting for them: `start` waits,
        so their start-up overlaps the trainer's."""
        self.engines.launch(model_dir)

    def start(self, model_dir: str | Path, holders=None, colocated_fraction: float | None = None) -> None:
        """Start the engines on `model_dir` (or connect to rollout.engines.urls) and wait until every
        one answers; then the rollout strategy, the supervisor of the engines and the weight-update
        group (colocated on several GPUs, `holders`: weights/sync.HandleHolders)."""
        from bapo_megatron.weights.engine_updates import EngineUpdates

        self._start_engines(model_dir, colocated_fraction)
        self.updates = EngineUpdates(
            self.cfg,
            self.engines,
            self.supervisor,
            self.prompts,
            self.strategy.paused,
            self.evaluations.wait,
            holders,
            self.adapters,
        )
        self.loop.run(self.supervisor.start())

    def start_generating(self, model_dir: str | Path) -> None:
        """--rollout-only: the engines on `model_dir` (or rollout.engines.urls), the strategy and the
        supervisor, and no weight outlet: the weights they start with are the ones they keep."""
        self._start_engines(model_dir, None)
        self.loop.run(self.supervisor.start())

    def _start_engines(self, model_dir: str | Path, colocated_fraction: float | None) -> None:
        pool = self.engines.start(model_dir, colocated_fraction)
        core = rollout_core(self.cfg, pool, self.buffer, self.inputs, self.rewards, self.adapters)
        self.strategy = make_strategy(self.cfg, core)
        e = self.cfg.rollout.engines  # colocated engines share the trainer's GPUs: one that dies stops the run
        self.supervisor = Supervisor(pool, self.engines.servers, e.max_restarts, e.startup_timeout_s, not e.colocate)

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
        answer = self._rollout(version, stopping)
        if not isinstance(answer, tuple):
            return answer
        groups, stats = answer
        checked = self.failing_rewards.check(groups, version + 1)  # before the step trains on it
        batch = self.buffer.batch(groups, version, self.cfg.rollout.sampling.temperature)
        self.records.write(version + 1, groups, batch, self.buffer.oldest_allowed(version))
        self.updates.release_memory()
        figures = {**stats, **checked, **self.buffer.batch_figures(groups, version), **self._data_figures()}
        return Ready(batch, figures)

    def rollout_step(self, step: int) -> dict[str, float]:
        """--rollout-only: step `step`'s groups, generated by the weights the engines started with
        (policy version 0 throughout: nothing trains), scored and written to the run's records; their
        figures with the rewards' spread (reward_figures). A signal ends it at once (no step to save)."""
        answer = self._rollout(0, stopping=lambda: False)
        if isinstance(answer, Refit):  # a restarted engine waits for weights that only a trainer sends
            raise RunStopped("no engine serves: one was restarted and --rollout-only sends no weights")
        groups, stats = answer
        checked = self.failing_rewards.check(groups, step)
        batch = self.buffer.batch(groups, 0, self.cfg.rollout.sampling.temperature)
        self.records.write(step, groups, batch, self.buffer.oldest_allowed(0))
        figures = {**stats, **checked, **self.buffer.batch_figures(groups, 0), **self._data_figures()}
        return {**reward_figures(groups), **figures}  # (rollout.filter_groups' own flat share, when it sifts)

    def _rollout(self, version: int, stopping) -> tuple[list[GroupState], dict[str, float]] | Refit | GiveUp:
        """The step's groups and the strategy's figures, once all are in; else why the step cannot
        wait for them now (the rollout, kept across a refit, goes on meanwhile)."""
        core, wanted = self.strategy.core, self.cfg.rollout.prompts_per_step
        with Progress(wanted, f"rollout {version}", unit="group", enabled=self.progress) as bar:
            core.on_progress = lambda groups, tokens: bar.reach(min(groups, wanted), f"{tokens:,} tokens")
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
                return batch.result()
            finally:
                core.on_progress = None

    def _data_figures(self) -> dict[str, float]:
        if self.cfg.data.max_prompt_tokens is None:
            return {}
        return {"data/prompts_dropped": float(self.prompts.dropped)}  # so far, this run and before

    def evaluate(self, version: int, stopping=lambda: False) -> Future | None:
        """The held-out evaluation of the weights the engines serve (version `version`) when eval.*
        says it is due, beside rollout; the next weight update waits for it (rollout/evaluation.py)."""
        return self.evaluations.start(version, self.engines.pool, stopping)

    @contextlib.contextmanager
    def quiesced(self):
        """Nothing in flight meanwhile (requests aborted, their output kept; every reward in): the
        state a checkpoint holds. Generation goes on afterwards."""
        self.evaluations.wait()
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


def reward_figures(groups: list[GroupState]) -> dict[str, float]:
    """The spread of a step's rewards, beside the mean the buffer reports: their deviation, the share
    of positive ones (the accuracy of a 0/1 or -1/1 reward), the share of groups whose samples all
    scored the same (flat: they would train nothing), and the shortest and longest response."""
    rewards = [s.reward for g in groups for s in g.samples]
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    mean = sum(rewards) / len(rewards)
    return {
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5,
        "rollout/reward_positive_share": sum(r > 0 for r in rewards) / len(rewards),
        "rollout/flat_share": sum(g.equal_rewards for g in groups) / len(groups),
        "rollout/response_length_min": float(min(lengths)),
        "rollout/response_length_max": float(max(lengths)),
    }
