"""Held-out evaluation through the training engines, at a known policy version, beside rollout.

eval/greedy_acc is the mean reward of one greedy answer a prompt; eval/avg@k the mean reward of k
samples at the rollout temperature; eval/pass@k the mean over prompts of the best of the k (the
share solved, for 0/1 rewards). Sampling seeds depend on the prompt and sample only, so two
evaluations differ by the weights alone. Requests go to the engines the rollout uses, through
the same pool (its failover included); the caller keeps the weights fixed until `run` returns,
so every answer is of the version it reports (eval/version), in asynchronous training too.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from typing import Any

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import EvalConfig, SamplingConfig
from bapo_megatron.rollout.client import EngineUnavailable
from bapo_megatron.rollout.pool import EnginePool
from bapo_megatron.rollout.reward_workers import RewardWorkers


class HeldOut:
    def __init__(
        self,
        items: list[tuple[list[int], dict[str, Any]]],
        cfg: EvalConfig,
        sampling: SamplingConfig,
        seed: int,
        reward: RewardWorkers,
        decode: Callable[[list[int]], str],
        slots: int,
    ) -> None:
        self.items, self.cfg, self.sampling, self.seed = items, cfg, sampling, seed
        self.reward, self.decode, self.slots = reward, decode, slots

    def due(self, step: int, last: int) -> bool:
        """Whether step `step` is evaluated: the start (0), every eval.interval steps, the last."""
        if not self.items:
            return False
        return step == 0 or step == last or bool(self.cfg.interval and step % self.cfg.interval == 0)

    def _jobs(self) -> list[tuple[int, int, SamplingParams]]:
        s, jobs = self.sampling, []
        for i in range(len(self.items)):
            if self.cfg.greedy:
                jobs.append((i, -1, SamplingParams(s.max_new_tokens, temperature=0.0)))
            for j in range(self.cfg.samples):
                seed = (self.seed * 1_000_003 + i * 1_009 + j) % 2**31
                params = SamplingParams(
                    s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, sampling_seed=seed
                )
                jobs.append((i, j, params))
        return jobs

    async def run(self, pool: EnginePool, version: int) -> dict[str, float]:
        start = time.monotonic()
        slots = asyncio.Semaphore(self.slots)

        async def one(i: int, j: int, sampling: SamplingParams) -> tuple[int, int, float, int]:
            ids, meta = self.items[i]
            async with slots:
                while True:
                    engine = await pool.pick(prefer=i % len(pool))
                    try:
                        with pool.holding(engine) as client:
                            done = await client.generate(list(ids), sampling, f"eval-{i}-{j}-{secrets.token_hex(4)}")
                        break
                    except EngineUnavailable:
                        pool.mark_dead(engine)
            scored = await self.reward(self.decode(done.output_ids), done.output_ids, meta)
            return i, j, scored.value, len(done.output_ids)

        results = await asyncio.gather(*(one(*job) for job in self._jobs()))
        n, k = len(self.items), self.cfg.samples
        out = {
            "eval/version": float(version),
            "eval/prompts": float(n),
            "eval/response_length": sum(r[3] for r in results) / len(results),
        }
        if self.cfg.greedy:
            out["eval/greedy_acc"] = sum(r[2] for r in results if r[1] < 0) / n
        if k:
            sampled: dict[int, list[float]] = {}
            for i, j, reward, _ in results:
                if j >= 0:
                    sampled.setdefault(i, []).append(reward)
            out[f"eval/avg@{k}"] = sum(sum(v) / k for v in sampled.values()) / n
            out[f"eval/pass@{k}"] = sum(max(v) for v in sampled.values()) / n
        out["time/eval"] = time.monotonic() - start
        return out
