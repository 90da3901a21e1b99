"""One rollout step over a pool of engines: requests out, groups of finished samples back.

A step keeps ceil(prompts_per_step x oversample) groups in flight, sends every unfinished
sample's request (capped by the partial-rollout token budget) to the least-loaded live
engine, records each completion's tokens, log-probs and versions as it arrives, scores
finished samples beside generation, and returns as soon as prompts_per_step groups are
complete. What is still generating is then aborted: with partial rollout its partial
output stays in the buffer and continues next step; without, it is discarded. In retract
mode it keeps generating inside the engines instead, across weight updates (RolloutManager).

Faults: a request that fails with EngineUnavailable (after the client's retries) marks its
engine dead and is resubmitted to another; dead engines are probed and come back when
they answer /health again. A request the engine answers with a failure (an abort carrying an
error status) keeps what it generated and is sent again; the same sample failing
MAX_SAMPLE_FAILURES times in a row stops the rollout with its error (RolloutError), rather than
resubmitting it for ever. A completion's tokens are recorded exactly once, by the one
request that produced them, so no sample is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable
from typing import Any

from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.errors import RunStopped
from bapo_megatron.rollout.client import EngineClient, EngineError, EngineUnavailable
from bapo_megatron.rollout.partial import GroupState, PartialRolloutBuffer, Request
from bapo_megatron.rollout.rewards import RewardWorkers

PromptFn = Callable[[], tuple[str, list[int], dict[str, Any]]]
MAX_SAMPLE_FAILURES = 3


class RolloutError(RunStopped):
    """A sample the engines failed to generate MAX_SAMPLE_FAILURES times in a row."""


class EnginePool:
    """Live engines and their load; waits (up to timeout_s) for one to come back when all are down."""

    def __init__(self, clients: list[EngineClient], timeout_s: float = 600.0, probe_s: float = 0.5) -> None:
        if not clients:
            raise ValueError("no engines")
        self.clients = clients
        self.load = dict.fromkeys(range(len(clients)), 0)
        self.dead: set[int] = set()
        self.timeout_s, self.probe_s = timeout_s, probe_s
        self.failures = 0

    async def pick(self, prefer: int | None = None) -> int:
        """`prefer` when it is alive (the engine holding a continued sample's prefix in its cache),
        else the least-loaded live engine."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if prefer is not None and prefer in self.load and prefer not in self.dead:
                return prefer
            live = [i for i in self.load if i not in self.dead]
            if live:
                return min(live, key=lambda i: self.load[i])
            for i in list(self.dead):
                if await self.clients[i].health():
                    self.dead.discard(i)
            if len(self.dead) < len(self.load):
                continue
            if time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"no engine answered for {self.timeout_s:.0f} s: {[c.base_url for c in self.clients]}"
                )
            await asyncio.sleep(self.probe_s)

    def mark_dead(self, index: int) -> None:
        self.dead.add(index)
        self.failures += 1


class RolloutManager:
    """Rollout steps over an engine pool (see the module). mode:

    - "abort" (default): what is still generating when a step has its groups is aborted; its
      partial output waits in the buffer (partial rollout) or is dropped, and the next step
      resubmits it, capped by the token budget, under the weights of that step.
    - "retract": requests stay inside the engines across steps and weight updates (the
      engines pause in retract mode around an update, `weight_update()`, and continue the
      requests under the new weights); no token budget, per-token versions from the engines.
      A request begun more than max_staleness versions ago is aborted at the next step and
      its sample dropped if stale. `drain()` aborts what runs, keeping its output (before a
      checkpoint or at shutdown).
    """

    def __init__(
        self,
        pool: EnginePool,
        buffer: PartialRolloutBuffer,
        prompts: PromptFn,
        reward: RewardWorkers,
        sampling: SamplingParams,
        prompts_per_step: int,
        oversample: float = 1.0,
        partial: bool = True,
        decode: Callable[[list[int]], str] | None = None,
        mode: str = "abort",
        deterministic_seed: int | None = None,
    ) -> None:
        if mode not in ("abort", "retract"):
            raise ValueError(f"mode must be 'abort' or 'retract', got {mode!r}")
        if mode == "retract" and not partial:
            raise ValueError("mode='retract' keeps requests across steps: it needs partial=True")
        if mode == "retract" and deterministic_seed is not None:
            raise ValueError("mode='retract' lets the engines decide when requests continue: it is not deterministic")
        self.pool, self.buffer, self.prompts, self.reward = pool, buffer, prompts, reward
        self.sampling, self.partial, self.retract = sampling, partial, mode == "retract"
        self.prompts_per_step = prompts_per_step
        self.in_flight_groups = math.ceil(prompts_per_step * oversample)
        self.decode = decode or (lambda ids: "")
        self._attempt = 0
        self.rounds = 0
        self.deterministic_seed = deterministic_seed
        self._engine_of: dict[str, int] = {}  # request id -> the engine it was last sent to
        self._home: dict[str, int] = {}  # sample uid -> the engine that generated its last tokens
        self._failures: dict[str, int] = {}  # sample uid -> failed completions in a row
        # generating now: task -> (request, request id, the version live when it was sent)
        self._running: dict[asyncio.Task, tuple[Request, str, int]] = {}
        self.stats: dict[str, float] = {}
        # called as on_progress(complete groups, tokens generated) as a step goes (a progress bar)
        self.on_progress: Callable[[int, int], None] | None = None

    async def step(self, version: int) -> list[GroupState]:
        """Generate until prompts_per_step groups are complete (and rewarded); return them, oldest first.

        Abort mode: each request carries at most the token budget (a round of its sample); a sample
        cut at its budget begins another round at once, but only while too few groups are complete.
        Deterministic (`deterministic_seed` set): see `_step_in_rounds`.
        """
        start = time.monotonic()
        while self.buffer.in_flight < self.in_flight_groups:
            self.buffer.add_group(*self.prompts())
        if self.deterministic_seed is not None:
            return await self._step_in_rounds(version, start)
        tokens = 0
        if self.retract:  # requests begun too long ago: their output so far is recorded, then judged
            stale = [t for t, (_, _, sent) in self._running.items() if version - sent > self.buffer.max_staleness]
            tokens += await self._cut(stale, version, keep=True)
        self.buffer.drop_stale(version, self._busy())  # once per step: this step's tokens are never stale in it
        pending_rewards: set[asyncio.Task] = set()
        budget = self.buffer.token_budget
        used: dict[str, int] = {}  # tokens each sample has generated in its current round
        rounds: dict[str, int] = {}  # rounds each sample has begun in this step

        def launch() -> None:
            """Send every idle unfinished sample. One cut at its round's budget begins its next round
            at once: rounds are per sample, so the engines never wait for a round's slowest request."""
            for req in self.buffer.requests(self._busy()):
                uid = req.sample.uid
                if uid not in rounds or used.get(uid, 0) >= budget:
                    rounds[uid], used[uid] = rounds.get(uid, 0) + 1, 0
                if not self.retract:
                    req.max_new_tokens = min(req.max_new_tokens, budget - used[uid])
                self._attempt += 1
                rid = f"{uid}#{self._attempt}"
                self._running[asyncio.create_task(self._generate(req, rid))] = (req, rid, version)

        def complete() -> int:
            return sum(g.finished for g in self.buffer.groups.values())

        while complete() < self.prompts_per_step:
            launch()  # what is idle and unfinished: new, back within its round's budget, or a new round
            if not self._running and not pending_rewards:
                raise RuntimeError("rollout stalled: nothing to generate and too few complete groups")
            done, _ = await asyncio.wait(set(self._running) | pending_rewards, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task in pending_rewards:
                    pending_rewards.discard(task)
                    task.result()
                    continue
                req, _, _ = self._running.pop(task)
                completion = task.result()
                self.buffer.record(req, completion, version)
                # (retract mode: the request may have been sent in an earlier step)
                used[req.sample.uid] = used.get(req.sample.uid, 0) + len(completion.output_ids)
                tokens += len(completion.output_ids)
                if req.sample.finished:
                    pending_rewards.add(asyncio.create_task(self._score(req)))
            self._report(complete(), tokens)
        self.rounds = max(rounds.values(), default=0)
        if not self.retract:
            tokens += await self._cut(list(self._running), version, keep=self.partial)
        waited = time.monotonic()
        for task in pending_rewards:
            await task
        return self._finish(start, tokens, time.monotonic() - waited)

    async def _step_in_rounds(self, version: int, start: float) -> list[GroupState]:
        """The deterministic step: synchronous rounds in which every unfinished sample generates up
        to the token budget with its own sampling seed (from the run's seed, the sample's id and its
        length so far, as SGLang's sampling_seed), until prompts_per_step groups are complete. What
        a step trains on then depends on nothing but the seed and the weights: never on timing."""
        self.buffer.drop_stale(version)
        tokens, self.rounds, reward_wait = 0, 0, 0.0
        while sum(g.finished for g in self.buffer.groups.values()) < self.prompts_per_step:
            requests = self.buffer.requests()
            if not requests:
                raise RuntimeError("rollout stalled: nothing to generate and too few complete groups")
            self.rounds += 1
            tasks = []
            for req in requests:
                self._attempt += 1
                tasks.append(asyncio.create_task(self._generate(req, f"{req.sample.uid}#{self._attempt}")))
            completions = await asyncio.gather(*tasks)
            for req, completion in zip(requests, completions, strict=True):  # in the buffer's order
                self.buffer.record(req, completion, version)
                tokens += len(completion.output_ids)
            self._report(sum(g.finished for g in self.buffer.groups.values()), tokens)
            waited = time.monotonic()
            await asyncio.gather(*(self._score(req) for req in requests if req.sample.finished))
            reward_wait += time.monotonic() - waited
        if not self.partial:
            for group in self.buffer.groups.values():
                for s in group.samples:
                    if not s.finished:
                        s.reset()
        return self._finish(start, tokens, reward_wait)

    def _report(self, groups: int, tokens: int) -> None:
        if self.on_progress is not None:
            self.on_progress(min(groups, self.prompts_per_step), tokens)

    def _seed_of(self, req: Request) -> int | None:
        if self.deterministic_seed is None:
            return None
        key = f"{self.deterministic_seed}/{req.sample.uid}/{len(req.sample.response_ids)}/{req.sample.regenerated}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1

    def _finish(self, start: float, tokens: int, reward_wait: float) -> list[GroupState]:
        """The step's complete groups, oldest first, and its stats; reward_wait: seconds spent waiting
        for rewards after generation had finished (scoring beside generation hides the rest)."""
        groups = self.buffer.pop_finished(self.prompts_per_step)
        elapsed = time.monotonic() - start
        self.stats = {
            "rollout/seconds": elapsed,
            "rollout/reward_wait": reward_wait,
            "rollout/tokens": tokens,
            "rollout/rounds": self.rounds,
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/in_buffer": self.buffer.in_flight,
            "rollout/in_engines": len(self._running),
            "rollout/dropped_stale": self.buffer.counters["dropped_stale"],
            "rollout/engine_failures": self.pool.failures,
            "rollout/reward_errors": self.reward.failures,
        }
        return groups

    def _busy(self) -> frozenset[str]:
        return frozenset(req.sample.uid for req, _, _ in self._running.values())

    @contextlib.asynccontextmanager
    async def weight_update(self):
        """Around a weight sync. Retract mode: the live engines pause (keeping their requests,
        dropping their KV caches) and continue afterwards under the new weights. Abort mode:
        nothing generates between steps, so nothing to do."""
        live = self._live() if self.retract else []
        await self._each(live, lambda client: client.pause("retract"))
        try:
            yield
        finally:
            await self._each(live, lambda client: client.resume())

    async def release_memory(self) -> None:
        """Colocated with the trainer: the live engines free their memory (weights, KV cache, CUDA
        graphs) while it trains. No request may be running in them: in abort mode call this
        between steps; in retract mode inside weight_update() (paused, requests kept). Their
        weights then hold nothing until resume_memory(["weights"]) and a weight sync."""
        await self._each(self._live(), lambda client: client.release_memory())

    async def resume_memory(self, tags: list[str]) -> None:
        """Take released memory back: ["weights"] before the weight sync loads them, then
        ["kv_cache", "cuda_graph"] after it."""
        await self._each(self._live(), lambda client: client.resume_memory(tags))

    def _live(self) -> list[int]:
        return [i for i in range(len(self.pool.clients)) if i not in self.pool.dead]

    async def _each(self, engines: list[int], call: Callable[[EngineClient], Any]) -> None:
        """call(client) on these engines at once; one found unavailable is marked dead (its requests
        fail over to another engine)."""

        async def one(index: int) -> None:
            try:
                await call(self.pool.clients[index])
            except EngineUnavailable:
                self.pool.mark_dead(index)

        await asyncio.gather(*(one(i) for i in engines))

    async def drain(self, version: int) -> int:
        """Abort every request still generating and keep its output in the buffer (retract mode keeps
        requests between steps; call this before saving the buffer). Returns the tokens recorded."""
        return await self._cut(list(self._running), version, keep=True)

    async def _cut(self, tasks: list[asyncio.Task], version: int, keep: bool) -> int:
        """Abort these requests; keep their partial output (record it) or drop it (reset the sample)."""
        if not tasks:
            return 0
        for task in tasks:
            rid = self._running[task][1]
            if rid not in self._engine_of:  # it has just returned
                continue
            client = self.pool.clients[self._engine_of[rid]]
            with contextlib.suppress(EngineUnavailable, EngineError):  # a dead engine: its request fails below
                await client.abort(rid)
        tokens = 0
        for task in tasks:
            req, _, _ = self._running.pop(task)
            try:
                completion = await task
            except EngineUnavailable:
                continue
            if keep:
                self.buffer.record(req, completion, version)
                tokens += len(completion.output_ids)
                if req.sample.finished:
                    await self._score(req)
            else:
                req.sample.reset()
        return tokens

    async def _generate(self, req: Request, rid: str):
        seed = self._seed_of(req)
        sampling = dataclasses.replace(self.sampling, max_new_tokens=req.max_new_tokens, sampling_seed=seed)
        uid = req.sample.uid
        try:
            while True:
                index = await self.pool.pick(prefer=self._home.get(uid) if req.sample.response_ids else None)
                self._engine_of[rid] = index
                self.pool.load[index] += 1
                try:
                    completion = await self.pool.clients[index].generate(req.input_ids, sampling, rid)
                    self._home[uid] = index
                    self._count_failure(uid, completion)
                    return completion
                except EngineUnavailable:
                    self.pool.mark_dead(index)  # resubmitted elsewhere (or here, once it answers again)
                finally:
                    self.pool.load[index] -= 1
        finally:
            del self._engine_of[rid]  # only requests still generating are looked up (to abort them)

    def _count_failure(self, uid: str, completion) -> None:
        if completion.error is None:
            self._failures.pop(uid, None)
            return
        self._failures[uid] = self._failures.get(uid, 0) + 1
        if self._failures[uid] >= MAX_SAMPLE_FAILURES:
            raise RolloutError(
                f"sample {uid}: the engine failed it {self._failures[uid]} times in a row, last: {completion.error}"
            )

    async def _score(self, req: Request) -> None:
        s = req.sample
        group = self.buffer.group_of(s)
        response = list(s.response_ids)
        reward = await self.reward(self.decode(response), response, group.meta)
        if s.finished and s.response_ids == response:  # not reset while it was being scored
            s.reward = reward
            self._home.pop(s.uid, None)
