"""What every rollout strategy does the same way: requests out to the engines, completions and rewards in.

`RolloutCore` sends a buffer request to the least-loaded live engine (the one holding a
continued sample's prefix when it is alive), records each completion's tokens, log-probs and
versions in the buffer as it arrives, and scores finished samples beside generation (those that
finish in one turn of the event loop in one reward call: a step's samples, all finishing at once,
cost a message to the reward workers, not a task and a pipe round trip each). The strategies
(rollout/strategies.py) decide only when to send, when to stop and what to cut.

Faults: a request that fails with EngineUnavailable marks its engine dead (engines/pool.py) and
is resubmitted elsewhere. One answered wrongly (BadAnswer: engines/client.py checks every answer
on arrival, for tokens outside the vocabulary, log-probs above 0, routes of another shape...)
retires its engine and is resubmitted the same way, nothing of the answer kept; the pool stops the
run at its MAX_RETIRED-th retirement. A request the engine answers with a failure (an abort
carrying an error status) keeps what it generated and is sent again; the same sample failing
MAX_SAMPLE_FAILURES times in a row stops the rollout with its error (RolloutError), rather
than resubmitting it for ever. A completion's tokens are recorded exactly once, by the one
request that produced them, so no sample is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hashlib
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from bapo_megatron.common.protocol import Completion, SamplingParams
from bapo_megatron.engines.client import EngineError, EngineUnavailable
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.errors import RunStopped
from bapo_megatron.rewards.workers import RewardWorkers
from bapo_megatron.rollout.adapters import ServedAdapter
from bapo_megatron.rollout.buffer import Request, RolloutBuffer, SampleState

PromptFn = Callable[[], tuple[str, list[int], dict[str, Any]]]
MAX_SAMPLE_FAILURES = 3


class Calls(enum.Enum):
    """How requests share /generate calls (RolloutCore.launch). A shared call is answered when all of
    its requests have finished, so a strategy shares only what it waits for together anyway: a cut
    request's answer would wait for the rest of its call, a finished group's reward for the others."""

    SAMPLE = "sample"
    """A call each: requests are recorded and scored as each finishes."""
    GROUP = "group"
    """A group's requests sent in one turn of the loop: one call (a group is scored once complete)."""
    ROUND = "round"
    """Every request sent together (launch_all): one call an engine. For a strategy that waits for
    every request of a round, where a call costs as much as generation (the embedded engine: a
    step's 32 group calls took 19 ms of its 118 ms rollout in benchmarks/bench_vs_trl.py)."""


class RolloutError(RunStopped):
    """A sample the engines failed to generate MAX_SAMPLE_FAILURES times in a row."""


@dataclass
class Flight:
    """A request being generated: what it is, its id, the engine it is on, the version live when sent."""

    request: Request
    rid: str
    sent: int
    engine: int | None = None
    cut: bool = False  # aborted by `cut`: never resubmitted when its engine dies meanwhile
    together: Hashable | None = None  # the key of the /generate call it shares with others (None: its own)


class RolloutCore:
    def __init__(
        self,
        pool: EnginePool,
        buffer: RolloutBuffer,
        prompts: PromptFn,
        reward: RewardWorkers,
        sampling: SamplingParams,
        decode: Callable[[list[int]], str] | None = None,
        deterministic_seed: int | None = None,
        adapters: ServedAdapter | None = None,
    ) -> None:
        """adapters: the LoRA adapter each request names and its tokens' version (model.lora.sync
        adapter; rollout/adapters.py); None: none, the engines' weights and versions alone."""
        self.pool, self.buffer, self.prompts, self.reward = pool, buffer, prompts, reward
        self.adapters = adapters or ServedAdapter()
        self.sampling, self.decode = sampling, decode or (lambda ids: "")
        self.deterministic_seed = deterministic_seed
        self.running: dict[asyncio.Task, Flight] = {}
        self.cutting: dict[asyncio.Task, Flight] = {}  # being aborted: theirs to record, nobody else's
        self.scoring: dict[asyncio.Task, list[SampleState]] = {}  # a reward call of these samples
        self._to_score: list[SampleState] | None = None  # the call forming in this turn of the loop
        self.tokens = 0  # recorded so far (a step's count is a difference)
        self._attempt = 0
        self._round = 0  # launch_all calls so far: a ROUND call's key
        self._home: dict[str, int] = {}  # sample uid -> the engine that generated its last tokens
        self._failures: dict[str, int] = {}  # sample uid -> failed completions in a row
        # called as on_progress(complete groups, tokens recorded) as a step goes (a progress bar)
        self.on_progress: Callable[[int, int], None] | None = None

    # -- what to generate ---------------------------------------------------------------------
    def fill(self, generating: int, admit: Callable[[], bool] = lambda: True) -> None:
        """Draw prompts until `generating` groups are incomplete in the buffer (while admit())."""
        while self.buffer.generating < generating and admit():
            self.buffer.add_group(*self.prompts())

    def busy(self) -> frozenset[str]:
        """Samples being generated, aborted or scored now."""
        flights = [*self.running.values(), *self.cutting.values()]
        scored = frozenset(s.uid for samples in self.scoring.values() for s in samples)
        return frozenset(f.request.sample.uid for f in flights) | scored

    def stale_flights(self, version: int) -> list[asyncio.Task]:
        """Requests whose tokens policy version `version` may no longer train on: sent by an older
        version than the bound allows, or continuing a sample that holds such tokens already."""
        oldest = self.buffer.oldest_allowed(version)
        return [
            task
            for task, f in self.running.items()
            if f.sent < oldest or (f.request.sample.versions and min(f.request.sample.versions) < oldest)
        ]

    def launch_idle(self, version: int, calls: Calls = Calls.SAMPLE) -> int:
        """Send every idle unfinished sample (rounds and budget: the buffer's) and score every finished
        one that nothing scores (after a restore); returns how many requests went out. calls: how
        they share /generate calls (Calls)."""
        self.rescore()
        requests = self.buffer.begin_requests(self.busy())
        self.launch_all(requests, version, calls)
        return len(requests)

    def launch_all(self, requests: list[Request], version: int, calls: Calls = Calls.SAMPLE) -> list[asyncio.Task]:
        """Send these requests, sharing /generate calls as `calls` says; their tasks, in order."""
        self._round += 1
        return [self.launch(req, version, calls) for req in requests]

    def launch(self, req: Request, version: int, calls: Calls = Calls.SAMPLE) -> asyncio.Task:
        """Send one sample's request. Requests given one key in a turn of the loop go to an engine in
        one /generate call (engines/client.py: `together`), answered when all of them have finished:
        calls=GROUP keys by the sample's group, ROUND by the launch_all call that sent it, SAMPLE
        gives none (a call each)."""
        self._attempt += 1
        together: Hashable | None = None
        if calls is Calls.GROUP:
            together = self.buffer.group_of(req.sample).uid
        elif calls is Calls.ROUND:
            together = ("round", self._round)
        flight = Flight(req, f"{req.sample.uid}#{self._attempt}", version, together=together)
        task = asyncio.create_task(self._generate(flight))
        task.add_done_callback(_seen)
        self.running[task] = flight
        return task

    # -- what comes back ----------------------------------------------------------------------
    async def wait(self, *others: asyncio.Future, timeout: float | None = None) -> set[asyncio.Future]:
        """Wait until a request, a reward or one of `others` is done; record completions and rewards.
        Returns what of `others` is done."""
        pending = set(self.running) | set(self.scoring) | set(others)
        if not pending:
            raise RuntimeError("rollout stalled: nothing to generate and too few complete groups")
        done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task in self.running:
                self.completed(task)
            elif task in self.scoring:
                self._scored(task)
        self.report()
        return done & set(others)

    def completed(self, task: asyncio.Task) -> None:
        """Record the completion of a finished request task."""
        self._record(self.running.pop(task), task.result())

    def _record(self, flight: Flight, completion: Completion) -> None:
        self.buffer.record(flight.request, completion, flight.sent)
        self.tokens += len(completion.output_ids)
        if flight.request.sample.finished:
            self._score_later(flight.request.sample)

    def _score_later(self, sample: SampleState) -> None:
        """Score `sample` in the reward call that the samples finishing in this turn of the loop form."""
        if self._to_score is None:
            self._to_score = []
            self.scoring[asyncio.create_task(self._score(self._to_score))] = self._to_score
        self._to_score.append(sample)

    def _scored(self, task: asyncio.Task) -> None:
        if self.scoring.pop(task, None) is not None:  # (two waiters may see it done)
            task.result()  # a reward function's failure is scored 0 inside; anything else is a bug

    async def cancel_rewards(self) -> None:
        """Stop the reward calls in progress (a checkpoint, or a run stopping, need not wait for a
        slow verifier): their samples stay finished and unscored, and are scored again (`rescore`,
        or launch_idle after a restore)."""
        tasks = list(self.scoring)
        self.scoring.clear()  # before they end: a waiter that sees them end must not take them as its own
        self._to_score = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def rescore(self) -> None:
        """Score every finished sample that nothing scores."""
        for sample in self.buffer.unscored(self.busy()):
            self._score_later(sample)

    async def rewards(self) -> float:
        """Wait for every pending reward; the seconds it took."""
        start = time.monotonic()
        while self.scoring:
            done, _ = await asyncio.wait(set(self.scoring))
            for task in done:
                self._scored(task)
        return time.monotonic() - start

    async def cut(self, tasks: list[asyncio.Task], keep: bool) -> int:
        """Abort these requests; keep their partial output (record it) or drop it (reset the sample).
        Returns the tokens kept. A request not yet on an engine is cancelled: it generated nothing."""
        if not tasks:
            return 0

        async def abort(engine: int, rid: str) -> None:
            with contextlib.suppress(EngineUnavailable, EngineError):  # a dead engine: its request fails below
                await self.pool.clients[engine].abort(rid)

        on_engines = []  # (engine, request id) now: a request that returns meanwhile forgets its engine
        for task in tasks:
            flight = self.cutting[task] = self.running.pop(task)
            flight.cut = True
            if flight.engine is not None:
                on_engines.append((flight.engine, flight.rid))
            elif not task.done():
                task.cancel()
        await asyncio.gather(*(abort(engine, rid) for engine, rid in on_engines))
        await asyncio.wait(tasks)
        kept = 0
        for task in tasks:
            flight = self.cutting.pop(task)
            if not keep:
                self.buffer.restart(flight.request.sample)
            elif not (task.cancelled() or isinstance(task.exception(), EngineUnavailable)):
                self._record(flight, task.result())
                kept += len(task.result().output_ids)
        return kept

    def report(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.buffer.complete, self.tokens)

    # -- one request --------------------------------------------------------------------------
    def _seed_of(self, sample: SampleState) -> int | None:
        if self.deterministic_seed is None:
            return None
        key = f"{self.deterministic_seed}/{sample.uid}/{len(sample.response_ids)}/{sample.regenerated}"
        return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1

    async def _generate(self, flight: Flight) -> Completion:
        req = flight.request
        sampling = dataclasses.replace(
            self.sampling, max_new_tokens=req.max_new_tokens, sampling_seed=self._seed_of(req.sample)
        )
        uid = req.sample.uid
        try:
            while True:
                if flight.cut:  # its engine died as it was cut: what it generated there is lost, nothing waits
                    raise asyncio.CancelledError(f"{flight.rid} was cut and its engine died")
                flight.engine = await self.pool.pick(prefer=self._home.get(uid) if req.sample.response_ids else None)
                try:
                    with self.pool.holding(flight.engine) as client, self.adapters.named() as adapter:
                        completion = await client.generate(
                            req.input_ids,
                            sampling,
                            flight.rid,
                            req.routes_from,
                            together=flight.together,
                            **adapter.request,
                        )
                    completion = adapter.stamp(completion)  # its tokens: the version of the adapter it named
                    self._home[uid] = flight.engine
                    self._count_failure(uid, completion)
                    return completion
                except EngineUnavailable as err:  # a wrong answer (BadAnswer) too: the pool retires its engine
                    self.pool.failed(flight.engine, err)  # resubmitted elsewhere (or here, once it answers again)
                    flight.engine = None  # on no engine while it waits for one: a cut cancels it there
        finally:
            flight.engine = None  # only requests still generating are aborted by id

    def _count_failure(self, uid: str, completion: Completion) -> None:
        if completion.error is None:
            self._failures.pop(uid, None)
            return
        self._failures[uid] = self._failures.get(uid, 0) + 1
        if self._failures[uid] >= MAX_SAMPLE_FAILURES:
            raise RolloutError(
                f"sample {uid}: the engine failed it {self._failures[uid]} times in a row, last: {completion.error}"
            )

    async def _score(self, samples: list[SampleState]) -> None:
        if self._to_score is samples:  # the turn that formed the call is over: later samples form another
            self._to_score = None
        responses = [list(s.response_ids) for s in samples]
        calls = [(self.decode(r), r, self.buffer.group_of(s).meta) for s, r in zip(samples, responses, strict=True)]
        for s, response, scored in zip(samples, responses, await self.reward.score(calls), strict=True):
            if self.buffer.apply_reward(s, response, scored):
                self._home.pop(s.uid, None)

    # -- a step's figures -----------------------------------------------------------------------
    def stats(self, start: float, tokens_before: int, reward_wait: float, rounds: int) -> dict[str, float]:
        """A batch's rollout since `start`: its seconds, the tokens generated (`tokens_before`: the count
        at the start), the wait for rewards after generation, the most rounds of one sample, and
        where things stand."""
        elapsed = time.monotonic() - start
        tokens = self.tokens - tokens_before
        return {
            "rollout/seconds": elapsed,
            "rollout/reward_wait": reward_wait,
            "rollout/tokens": tokens,
            "rollout/rounds": rounds,
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/in_buffer": self.buffer.in_flight,
            "rollout/in_engines": len(self.running),
            "rollout/dropped_stale": self.buffer.counters["dropped_stale"],
            "rollout/engine_failures": self.pool.failures,
            "rollout/reward_errors": self.reward.failures,
            "rollout/reward_workers_replaced": self.reward.replaced,
        }


def _seen(task: asyncio.Task) -> None:
    """A request's failure (the run stopping: no engine can come back) is raised by the first
    `completed` that meets it; the same failure of the others is not reported again at exit."""
    if not task.cancelled():
        task.exception()
