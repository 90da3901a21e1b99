"""Held-out evaluation through the training engines, at a known policy version, beside rollout.

eval/greedy_acc is the mean reward of one greedy answer a prompt; eval/avg@k the mean reward of k
samples at the rollout temperature; eval/pass@k the mean over prompts of the best of the k (the
share solved, for 0/1 rewards). Sampling seeds depend on the prompt and sample only, so two
evaluations differ by the weights alone. Requests go to the engines the rollout uses, through
the same pool (its failover included); the caller keeps the weights fixed until `run` returns,
so every answer is of the version it reports (eval/version), in asynchronous training too.
Several sets (eval.sets) are evaluated together, each under eval/NAME/ (eval.path's under eval/).

    runs = HeldOutRuns(held_out, loop, cfg.steps)
    future = runs.start(version, pool, stopping)   # when due: on the engines' loop, beside rollout
    runs.wait()                                    # before the weights it reads change
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import EvalConfig, SamplingConfig
from bapo_megatron.engines.client import EngineUnavailable
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.adapters import ServedAdapter


@dataclass(frozen=True)
class EvalSet:
    """One evaluation set: its metrics' prefix ("eval/" for eval.path, "eval/NAME/" for eval.sets),
    its prompts (token ids and the record for the reward), k and whether to answer greedily."""

    prefix: str
    items: list[tuple[list[int], dict[str, Any]]]
    samples: int
    greedy: bool


class HeldOut:
    def __init__(
        self,
        sets: list[EvalSet],
        cfg: EvalConfig,
        sampling: SamplingConfig,
        seed: int,
        reward: RewardWorkers,
        decode: Callable[[list[int]], str],
        slots: int,
        adapters: ServedAdapter | None = None,
    ) -> None:
        """adapters: the LoRA adapter the answers come from (model.lora.sync adapter; None: none)."""
        self.sets = [s for s in sets if s.items]
        self.cfg, self.sampling, self.seed = cfg, sampling, seed
        self.reward, self.decode, self.slots = reward, decode, slots
        self.adapters = adapters or ServedAdapter()

    def due(self, step: int, last: int) -> bool:
        """Whether step `step` is evaluated: the start (0), every eval.interval steps, the last."""
        if not self.sets:
            return False
        return step == 0 or step == last or bool(self.cfg.interval and step % self.cfg.interval == 0)

    def _jobs(self) -> list[tuple[int, int, int, SamplingParams]]:
        """(set, prompt, sample (-1: greedy), sampling) of every answer an evaluation asks for. A
        prompt's sampling seeds depend on its place in its set and the sample only."""
        s, jobs = self.sampling, []
        for k, held in enumerate(self.sets):
            for i in range(len(held.items)):
                if held.greedy:
                    jobs.append((k, i, -1, SamplingParams(s.max_new_tokens, temperature=0.0)))
                for j in range(held.samples):
                    seed = (self.seed * 1_000_003 + i * 1_009 + j) % 2**31
                    params = SamplingParams(
                        s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, sampling_seed=seed
                    )
                    jobs.append((k, i, j, params))
        return jobs

    async def run(self, pool: EnginePool, version: int) -> dict[str, float]:
        start = time.monotonic()
        slots = asyncio.Semaphore(self.slots)

        async def one(k: int, i: int, j: int, sampling: SamplingParams) -> tuple[int, int, int, float, int]:
            ids, meta = self.sets[k].items[i]
            async with slots:
                while True:
                    engine = await pool.pick(prefer=i % len(pool))
                    try:
                        with pool.holding(engine) as client, self.adapters.named() as adapter:
                            request = f"eval-{k}-{i}-{j}-{secrets.token_hex(4)}"
                            # a prompt's answers in one call: an evaluation waits for them all, never cuts one
                            done = await client.generate(
                                list(ids), sampling, request, together=(k, i), **adapter.request
                            )
                        break
                    except EngineUnavailable as err:  # a wrong answer too: retired, counted toward the run's stop
                        pool.failed(engine, err)
            scored = await self.reward(self.decode(done.output_ids), done.output_ids, meta)
            return k, i, j, scored.value, len(done.output_ids)

        results = await asyncio.gather(*(one(*job) for job in self._jobs()))
        out = {"eval/version": float(version)}
        for k, held in enumerate(self.sets):
            mine = [r[1:] for r in results if r[0] == k]
            out.update(scores(held, mine))
        out["time/eval"] = time.monotonic() - start
        return out


class HeldOutRuns:
    """A run's held-out evaluations, one at a time, each on the engines' loop beside rollout: the
    caller waits for the one in progress before the weights it reads change."""

    def __init__(self, held_out: HeldOut, loop: EngineLoop, last_step: int) -> None:
        self.held_out, self.loop, self.last_step = held_out, loop, last_step
        self._running: Future | None = None

    def start(self, version: int, pool: EnginePool, stopping: Callable[[], bool]) -> Future | None:
        """The evaluation of version `version` (the weights the engines serve), started when eval.*
        says it is due. Given up, with no figures, when `stopping()` (a signal) comes while no
        engine serves: its requests would wait for engines that are gone, and the run's last line
        and checkpoint must not."""
        if not self.held_out.due(version, self.last_step):
            return None
        self.wait()
        self._running = self.loop.submit(self._run(version, pool, stopping))
        return self._running

    async def _run(self, version: int, pool: EnginePool, stopping: Callable[[], bool]) -> dict[str, float]:
        run = asyncio.ensure_future(self.held_out.run(pool, version))
        while not run.done():
            if stopping() and not pool.live():
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
                print(f"the held-out evaluation of version {version} is given up: the run is stopping", flush=True)
                return {}
            await asyncio.wait([run], timeout=0.2)
        return run.result()

    def wait(self) -> None:
        """The evaluation in progress (if any) finished."""
        if self._running is not None:
            self.loop.wait(self._running)
            self._running = None


def scores(held: EvalSet, results: list[tuple[int, int, float, int]]) -> dict[str, float]:
    """A set's figures from its (prompt, sample, reward, response length) results."""
    n, k, p = len(held.items), held.samples, held.prefix
    out = {f"{p}prompts": float(n), f"{p}response_length": sum(r[3] for r in results) / len(results)}
    if held.greedy:
        out[f"{p}greedy_acc"] = sum(r[2] for r in results if r[1] < 0) / n
    if k:
        sampled: dict[int, list[float]] = {}
        for i, j, reward, _ in results:
            if j >= 0:
                sampled.setdefault(i, []).append(reward)
        out[f"{p}avg@{k}"] = sum(sum(v) / k for v in sampled.values()) / n
        out[f"{p}pass@{k}"] = sum(max(v) for v in sampled.values()) / n
    return out
