"""Held-out evaluation through the training engines, at a known policy version, beside rollout.

eval/greedy_acc is the mean reward of one greedy answer a prompt; eval/avg@k the mean reward of k
samples at the rollout temperature; eval/pass@k the mean over prompts of the best of the k (the
share solved, for 0/1 rewards). Sampling seeds depend on the prompt and sample only, so two
evaluations differ by the weights alone. Requests go to the engines the rollout uses, through
the same pool (its failover included); the caller keeps the weights fixed until `run` returns,
so every answer is of the version it reports (eval/version), in asynchronous training too.
Several sets (eval.sets) are evaluated together, each under eval/NAME/ (eval.path's under eval/).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import EvalConfig, SamplingConfig
from bapo_megatron.engines.client import EngineUnavailable
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.rewards.workers import RewardWorkers


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
    ) -> None:
        self.sets = [s for s in sets if s.items]
        self.cfg, self.sampling, self.seed = cfg, sampling, seed
        self.reward, self.decode, self.slots = reward, decode, slots

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
                        with pool.holding(engine) as client:
                            request = f"eval-{k}-{i}-{j}-{secrets.token_hex(4)}"
                            done = await client.generate(list(ids), sampling, request)
                        break
                    except EngineUnavailable:
                        pool.mark_dead(engine)
            scored = await self.reward(self.decode(done.output_ids), done.output_ids, meta)
            return k, i, j, scored.value, len(done.output_ids)

        results = await asyncio.gather(*(one(*job) for job in self._jobs()))
        out = {"eval/version": float(version)}
        for k, held in enumerate(self.sets):
            mine = [r[1:] for r in results if r[0] == k]
            out.update(scores(held, mine))
        out["time/eval"] = time.monotonic() - start
        return out


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
