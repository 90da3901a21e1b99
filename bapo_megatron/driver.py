"""Rank 0's side of the online loop: the engines, the prompts, the rewards, the weight sync, evaluation.

    driver = RolloutDriver(cfg, spec, run_dir)      # data, reward, tokenizer, ports, engine URLs checked
    driver.start(model_dir)                         # engines started (or connected) and ready
    batch, metrics = driver.next_batch(version)     # prompts_per_step whole groups, rewarded
    metrics = driver.publish(buckets, version)      # every engine now serves `version`
    future = driver.evaluate(version)               # held-out figures of `version`, beside rollout
    driver.close()                                  # engines stopped, workers closed

The rollout runs on the engines' event loop, on a thread of its own (engines/loop.py), so that in
asynchronous mode it goes on while the trainer trains; this thread keeps torch's collectives
(the buckets of a weight sync) and blocks only where it waits for a batch or an answer. How
generation is scheduled is the rollout strategy's (rollout/strategies.py, by rollout.mode,
partial.mode and deterministic). Weights travel over a weight-update group from rank 0, or by
handle to colocated engines, whose memory is released while the trainer runs; after every sync
each engine's weight version is checked against the trainer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import socket
import time
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from bapo_megatron.common.batch import RolloutBatch, Sample
from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.common.progress import Progress, bars_on
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import JobConfig
from bapo_megatron.data.prompts import PromptLimits, PromptSource, load_tokenizer
from bapo_megatron.engines.client import EngineUnavailable
from bapo_megatron.engines.fleet import Engines
from bapo_megatron.engines.launcher import free_port
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.supervisor import Supervisor
from bapo_megatron.errors import BadInputError, ConfigError, RunStopped
from bapo_megatron.rewards.functions import load_reward, reward_spec
from bapo_megatron.rewards.workers import FailingRewards, RewardWorkers
from bapo_megatron.rollout.buffer import GroupState, RolloutBuffer
from bapo_megatron.rollout.core import RolloutCore
from bapo_megatron.rollout.evaluation import EvalSet, HeldOut
from bapo_megatron.rollout.strategies import AbortSteps, AsyncStream, DeterministicRounds, RetractSteps, Strategy

PROBE_TOKENS = 16
REFIT, GIVEN_UP = "refit", "given up"
"""next_batch's answers while the rollout waits for an engine that needs the weights, and when the
job is stopping before the batch is complete."""


def make_strategy(cfg: JobConfig, core: RolloutCore) -> Strategy:
    """The rollout mode's strategy."""
    ro = cfg.rollout
    if ro.mode == "async":
        return AsyncStream(core, ro.prompts_per_step, ro.oversample, ro.pause_mode)
    if ro.deterministic:
        return DeterministicRounds(core, ro.prompts_per_step, ro.oversample)
    if ro.partial.enabled and ro.partial.mode == "retract":
        return RetractSteps(core, ro.prompts_per_step, ro.oversample)
    return AbortSteps(core, ro.prompts_per_step, ro.oversample, keep=ro.partial.enabled)


class RolloutDriver:
    def __init__(self, cfg: JobConfig, spec: ModelSpec, run_dir: Path) -> None:
        """Everything that can be checked without an engine or a model, checked: the dataset (every
        record), the reward (imported), the tokenizer (against the model's vocabulary), the held-out
        set, the engines' ports or URLs."""
        from bapo_megatron.trainer.parallel import local_world_size

        ro, data = cfg.rollout, cfg.data
        self.cfg, self.spec, self.run_dir = cfg, spec, Path(run_dir)
        if data.path is None:
            raise ConfigError("data.path", None, "generation needs prompts: a jsonl or parquet file")
        self.tokenizer = load_tokenizer(cfg.model.hf_path)
        if self.tokenizer is not None and len(self.tokenizer) > spec.vocab_size:
            raise BadInputError(
                f"model.hf_path={cfg.model.hf_path}: the tokenizer has {len(self.tokenizer)} tokens, more than "
                f"the model's vocabulary of {spec.vocab_size}"
            )
        self.reward = reward_spec(
            data.reward, data.reward_by, data.rewards, data.overlong_buffer, data.overlong_penalty_factor,
            ro.sampling.max_new_tokens,
        )  # fmt: skip
        field, value = ("data.rewards", data.rewards) if data.reward_by else ("data.reward", data.reward)
        try:
            load_reward(self.reward)
        except ValueError as err:
            raise ConfigError(field, value, str(err)) from None
        self.prompts = self._prompts("data.path", data)
        held_out = self._eval_sets()
        self.buffer = RolloutBuffer(
            ro.samples_per_prompt, ro.sampling.max_new_tokens, ro.token_budget, ro.max_staleness, ro.mask_stale_prefix
        )
        self.progress = bars_on(cfg.logging.progress)
        self.loop = EngineLoop()
        try:
            self.engines = Engines(cfg, spec, self.run_dir, self.loop, local_world_size())
        except BaseException:
            self.loop.close()
            raise
        self.rewards = RewardWorkers(  # processes start at the first score
            self.reward, data.reward_workers, timeout_s=data.reward_timeout_s, memory_mb=data.reward_memory_mb,
            bounds=data.reward_range,
        )  # fmt: skip
        self.failing_rewards = FailingRewards(
            data.reward if not data.reward_by else f"by {data.reward_by}", data.max_reward_failure_share,
            data.reward_failure_steps,
        )  # fmt: skip
        slots = ro.engines.max_batch * max(1, len(ro.engines.urls) or ro.engines.servers)
        self.held_out = HeldOut(held_out, cfg.eval, ro.sampling, cfg.seed, self.rewards, self._decode, slots)
        self.strategy: Strategy | None = None
        self.sender = None
        self.supervisor: Supervisor | None = None
        self.members: list[int] = []  # the engines in the weight-update group
        self.refit: list[int] = []  # engines sent the weights by the last publish while waiting for them
        self._batch: Future | None = None  # a step's rollout, across a refit
        self._evaluation: Future | None = None  # the held-out run in progress
        self._released = False  # colocated engines' memory given back (after a batch, before a sync)

    def _eval_sets(self) -> list[EvalSet]:
        """eval.path (metrics eval/*) and every eval.sets entry (eval/NAME/*), read with data's field
        map and checked as data.path is (the micro-batch aside: no gradient)."""
        e, sets = self.cfg.eval, []
        named = [("eval.path", "eval/", e.path, e.samples, e.max_prompts, e.greedy)] if e.path is not None else []
        for name, one in e.sets.items():
            samples = e.samples if one.samples is None else one.samples
            most = e.max_prompts if one.max_prompts is None else one.max_prompts
            greedy = e.greedy if one.greedy is None else one.greedy
            named.append((f"eval.sets.{name}.path", f"eval/{name}/", one.path, samples, most, greedy))
        for field, prefix, path, samples, most, greedy in named:
            if path is None:
                raise ConfigError(field, None, "is not set: the set's prompts (file, shards, glob)")
            if not samples and not greedy:
                raise ConfigError(field.removesuffix(".path"), path, "0 samples and greedy off evaluate nothing")
            source = self._prompts(field, dataclasses.replace(self.cfg.data, path=path, shuffle=False))
            sets.append(EvalSet(prefix, source.first(most), samples, greedy))
        return sets

    def _prompts(self, field: str, data) -> PromptSource:
        """data.path's prompts (or eval.path's): the first data.check_records checked now, each
        with room for max_new_tokens in the model's context (and, training, in one micro-batch)."""
        new, context = self.cfg.rollout.sampling.max_new_tokens, self.spec.max_position_embeddings
        limit = context - new
        reason = f"+ rollout.sampling.max_new_tokens ({new}) exceed the model's context of {context} tokens"
        microbatch = self.cfg.parallel.max_tokens_per_microbatch if field == "data.path" else None
        if microbatch is not None and microbatch - new < limit:
            limit = microbatch - new
            reason = (
                f"+ rollout.sampling.max_new_tokens ({new}) exceed parallel.max_tokens_per_microbatch={microbatch}: "
                "a sample must fit one micro-batch (data.max_prompt_tokens drops longer prompts)"
            )
        limits = PromptLimits(vocab_size=self.spec.vocab_size, max_tokens=limit, reason=reason)
        route = None
        if data.reward_by is not None:
            router = load_reward(self.reward)

            def route(meta: dict) -> None:  # every record checked ahead has a reward
                try:
                    router.route(meta)
                except KeyError as err:
                    raise ValueError(f"{err.args[0]} (data.reward_by)") from None

        try:
            return PromptSource(data, tokenizer=self.tokenizer, limits=limits, field=field, check=route)
        except ValueError as err:
            raise BadInputError(str(err)) from None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------------------------------
    # Engines.

    def start(self, model_dir: str | Path, holders=None, colocated_fraction: float | None = None) -> None:
        """Start the engines on `model_dir` (or connect to rollout.engines.urls) and wait until every
        one answers; then the rollout strategy and the weight sender (colocated on several GPUs,
        `holders`: weights/sync.HandleHolders)."""
        ro = self.cfg.rollout
        pool = self.engines.start(model_dir, colocated_fraction)
        s = ro.sampling
        core = RolloutCore(
            pool,
            self.buffer,
            self.prompts.next,
            self.rewards,
            SamplingParams(s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k),
            decode=self._decode,
            deterministic_seed=self.cfg.seed if ro.deterministic else None,
        )
        self.strategy = make_strategy(self.cfg, core)
        self.sender = self._weight_sender(holders)
        self.members = pool.serving()  # the engines in the weight-update group
        e = ro.engines  # colocated engines share the trainer's GPUs: one that dies stops the run
        self.supervisor = Supervisor(pool, self.engines.servers, e.max_restarts, e.startup_timeout_s, not e.colocate)
        self.loop.run(self.supervisor.start())

    def _weight_sender(self, holders=None):
        from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender

        ro, clients = self.cfg.rollout, self.engines.clients
        if ro.engines.colocate:
            return TensorWeightSender(clients, engine_tp=ro.engines.tensor_parallel, holders=holders)
        host = ro.sync.host or ("127.0.0.1" if not ro.engines.urls else socket.getfqdn())
        ranks = [ro.engines.tensor_parallel] * len(clients)
        timeout = ro.engines.startup_timeout_s
        sender = DistributedWeightSender(clients, ranks, host, free_port(host), timeout_s=timeout)
        self.loop.run(sender.connect())
        return sender

    # ------------------------------------------------------------------------------------------
    # One step.

    def needs_refit(self) -> bool:
        """No engine serves and one waits for the weights (brought back after a death): the step
        cannot go on until every rank helps send them (sources.OnlineSource.next_batch)."""
        pool = self.strategy.pool
        return bool(pool.refitting) and not pool.live()

    def next_batch(self, version: int, stopping=lambda: False) -> tuple[RolloutBatch, dict[str, float]] | str:
        """The next prompts_per_step complete groups, for policy version `version` to train on, and
        their figures; or REFIT, when the rollout waits for an engine that needs the weights (the
        step's rollout goes on where it was at the next call); or GIVEN_UP, when `stopping()` (a
        signal) comes first: the run ends without this step, from the state of its last checkpoint
        or its last step. Colocated engines then give their memory to the trainer until the sync."""
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
                    if self.needs_refit():  # no engine serves; one waits for the weights
                        return REFIT
                    if stopping():  # a signal: no step waits for slow engines or rewards
                        self._batch.cancel()
                        self._batch.unwound.wait(60)
                        self._batch = None
                        return GIVEN_UP
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
        )
        with (self.run_dir / "samples.jsonl").open("a") as f:  # which prompt groups the step trains on
            f.write(json.dumps({"step": version + 1, "groups": [g.uid for g in groups]}) + "\n")
        if ro.engines.colocate:
            self.loop.run(self.strategy.pool.each(lambda client: client.release_memory()))
            self._released = True
        figures = {**stats, **checked, **batch_figures(groups, version, ro.sampling.max_new_tokens, self.buffer)}
        if self.cfg.data.max_prompt_tokens is not None:
            figures["data/prompts_dropped"] = float(self.prompts.dropped)  # so far, this run and before
        return batch, figures

    def publish(self, buckets: Iterable, version: int) -> dict[str, float]:
        """Every bucket to every engine as weight version `version` (the engines paused as the mode
        wants meanwhile); each engine's version is then checked. An evaluation still running on the
        weights these replace finishes first."""
        self.wait_evaluation()
        start, pool = time.monotonic(), self.strategy.pool
        flush = not (self.cfg.rollout.mode == "async" and self.cfg.rollout.pause_mode == "in_place")
        with self.loop.context(self.strategy.paused(version)):
            self._regroup()
            if self._released:  # colocated: the engines hold no memory since the batch
                self.loop.run(pool.each(lambda client: client.resume_memory(["weights"])))
            sent = self._send(buckets, version, flush)
            if self._released:
                self.loop.run(pool.each(lambda client: client.resume_memory(["kv_cache", "cuda_graph"])))
                self._released = False
        for index in self.loop.run(self.engines.check_version(version, self.members)):
            self.loop.call(pool.mark_dead, index)  # died since the update: restarted, and sent the weights then
        self.refit = [i for i in self.members if i in pool.refitting]  # checked (sources.refit_probe), then revived
        return {
            "time/weight_sync": time.monotonic() - start,
            "sync/bytes": float(sent),
            "engine/live": len(pool.live()),
            "engine/restarts": float(self.supervisor.restarts),
        }

    def _send(self, buckets: Iterable, version: int, flush: bool) -> int:
        """The buckets to the group's engines; bytes sent. An engine that died during the update
        leaves the others with a mix of versions: every member then waits for the weights again
        (their requests aborted: what they generated before the pause is kept), and `members`
        is emptied so that the next publish, or the refit the rollout asks for, sends them anew."""
        from bapo_megatron.weights.sync import WeightSendFailed

        if not self.members:  # no engine answers: the trainer's ranks still gather (they come back to a refit)
            return sum(0 for _ in buckets)
        try:
            return self.sender.send(buckets, str(version), self.loop, flush_cache=flush)
        except WeightSendFailed as err:
            print(f"weight sync of version {version} failed ({err}): the engines get it again before serving")
            pool = self.strategy.pool

            async def set_aside(index: int) -> None:
                client = self.engines.clients[index]
                if await client.health():
                    pool.came_back(index)
                    with contextlib.suppress(Exception):
                        await client.abort()
                else:
                    pool.mark_dead(index)

            async def set_all_aside() -> None:
                await asyncio.gather(*(set_aside(i) for i in self.members))

            self.loop.run(set_all_aside())
            self.members = []
            return 0

    def revive(self, engines: list[int]) -> None:
        """These engines took the current weights and passed the checks: they serve again."""
        pool = self.strategy.pool
        for index in engines:
            if index in pool.refitting:  # (not dead since)
                print(f"engine {self.engines.clients[index].base_url} has the current weights: it serves again")
                self.loop.call(pool.revive, index)

    def _regroup(self) -> None:
        """The weight-update group holds the engines that answer (live, or back and waiting for the
        weights); a new group when that changed (an engine died, or came back). Colocated engines
        share the trainer's GPUs: one that died stops the run."""
        pool = self.strategy.pool
        members = pool.serving()
        if members == self.members:
            return
        gone = [self.engines.clients[i].base_url for i in self.members if i not in members]
        if gone and self.cfg.rollout.engines.colocate:
            raise RunStopped(f"colocated engine(s) {', '.join(gone)} died: their GPUs' weights cannot be served")
        if gone:
            print(
                f"engine(s) {', '.join(gone)} stopped answering: the weights go to the {len(members)} left", flush=True
            )
        self.members = members
        self.sender.clients = [self.engines.clients[i] for i in members]
        self.sender.engine_ranks = [self.cfg.rollout.engines.tensor_parallel] * len(members)
        if members:
            self.loop.run(self.sender.connect())  # the old group is left first (a dead end's refusal ignored)

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
        pool = self.strategy.pool
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

    def evaluate(self, version: int) -> Future | None:
        """Start the held-out evaluation of the weights the engines serve (version `version`) when
        eval.* says it is due; it runs beside rollout, and the next publish waits for it."""
        if not self.held_out.due(version, self.cfg.steps):
            return None
        self.wait_evaluation()
        self._evaluation = self.loop.submit(self.held_out.run(self.strategy.pool, version))
        return self._evaluation

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
            if self.sender is not None and hasattr(self.sender, "close"):
                self.loop.run(self.sender.close(), timeout=30)
        except Exception:  # the engines may be gone already: their end of the group is gone too
            pass
        finally:
            self.sender = None
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
