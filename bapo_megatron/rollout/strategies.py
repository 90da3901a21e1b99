"""How generation is scheduled against training: one strategy per rollout mode, over RolloutCore.

Each strategy answers the same four questions (`Strategy`):
- `batch(version)`: the next prompts_per_step complete groups for policy version `version`, oldest
  first, and the figures of their rollout;
- `paused(version)`: what the engines do around a weight update (to `version`);
- `drain()` / `resume()`: nothing in flight and every partial output in the buffer, before a
  checkpoint; generation going on after it.

The modes:
- `AbortSteps` (sync; partial rollout in abort mode, or none): a step generates until it has its
  groups, each request capped by the token budget, then aborts what still runs; partial
  output waits in the buffer (or is dropped) and continues next step. Nothing generates while
  the trainer trains.
- `RetractSteps` (sync, partial.mode retract): requests stay inside the engines across steps; the
  engines pause in retract mode around an update and continue them under the new weights.
- `DeterministicRounds` (sync, rollout.deterministic): synchronous rounds with seeded requests; what
  a step trains on depends on nothing but the seed and the weights.
- `AsyncStream` (rollout.mode async): a producer keeps groups generating while the trainer trains,
  admitted only while every group queued or generating can still be trained within
  max_staleness versions (AReaL's rule); a step takes the oldest complete groups; the engines
  pause (rollout.pause_mode) for each weight update.

Across the modes, rollout.filter_groups (rollout/filtering.py) sets aside the groups whose rewards
are all equal as they complete: a sync step draws a new prompt for each and generates on; the async
producer admits others in their place. A step ends once it has prompts_per_step groups to train
or its extra rounds are used up; short of them, it is topped up with groups set aside (warned about
or not) or stops the run, as rollout.filter_groups.on_shortfall says (`_take`, the filter's
`figures`). A step whose every group has equal rewards is warned about.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from bapo_megatron.rollout.buffer import GroupState
from bapo_megatron.rollout.core import Calls, RolloutCore
from bapo_megatron.rollout.filtering import KeepAll, warn_if_nothing


class Strategy:
    """The sync default of every question; the modes override what differs."""

    calls = Calls.SAMPLE
    """How its requests share /generate calls (rollout/core.Calls)."""

    def __init__(
        self, core: RolloutCore, prompts_per_step: int, oversample: float = 1.0, filter_groups: KeepAll | None = None
    ) -> None:
        self.core, self.buffer, self.pool = core, core.buffer, core.pool
        self.prompts_per_step = prompts_per_step
        self.generating = math.ceil(prompts_per_step * oversample)
        self.filter_groups = filter_groups or KeepAll()

    async def batch(self, version: int) -> tuple[list[GroupState], dict[str, float]]:
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def paused(self, version: int):
        """Around a weight update. Nothing generates between sync steps: nothing to do."""
        yield

    async def drain(self) -> None:
        """Before a checkpoint (or a run's end): nothing in flight; a reward call in progress is
        stopped, its sample saved unscored (scored again after the checkpoint, or the restore),
        so that a save never waits for a slow verifier."""
        await self.core.cut(list(self.core.running), keep=True)
        await self.core.cancel_rewards()

    async def resume(self) -> None:
        """After a checkpoint."""
        self.core.rescore()

    async def close(self) -> None:
        """Before the engines stop."""

    def _take(
        self, version: int, start: float, tokens: int, reward_wait: float
    ) -> tuple[list[GroupState], dict[str, float]]:
        """The groups policy version `version` trains on, and the figures of their rollout since
        `start` (`tokens`: the core's count then)."""
        rounds = self.buffer.rounds
        self.filter_groups.sift(self.buffer)  # (groups completed as the step ended)
        figures = self.filter_groups.figures(self.buffer, self.prompts_per_step, version + 1)
        groups = self.buffer.take(self.prompts_per_step)
        assert len(groups) == self.prompts_per_step, f"{len(groups)} complete groups of {self.prompts_per_step}"
        warn_if_nothing(groups, version + 1)
        return groups, {**self.core.stats(start, tokens, reward_wait, rounds), **figures}

    def _settled(self) -> bool:
        """Whether the step has its groups, after setting aside those not to train (rollout.filter_groups);
        if not, a new prompt is drawn for each set aside."""
        replace = self.filter_groups.sift(self.buffer)
        if self.filter_groups.enough(self.buffer, self.prompts_per_step):
            return True
        self.core.fill(self.buffer.generating + replace)
        return False

    async def _generate_until_complete(self, version: int) -> None:
        """Send what is idle (a sample cut at its round's budget begins its next round at once: the
        engines never wait for a round's slowest request) until the step has its groups."""
        while not self._settled():
            self.core.launch_idle(version, self.calls)
            await self.core.wait()


class AbortSteps(Strategy):
    """Sync: generate until the step's groups are complete, then abort what still runs, keeping its
    output for the next step (partial rollout) or dropping it."""

    def __init__(
        self,
        core: RolloutCore,
        prompts_per_step: int,
        oversample: float = 1.0,
        keep: bool = True,
        filter_groups: KeepAll | None = None,
        round_calls: bool = False,
    ) -> None:
        """round_calls: a round's requests share one call an engine when the step needs every group
        it draws (no oversampling, no filter_groups: nothing is cut or replaced while they run); else
        (and by default) a group's share one: a step ends by cutting all its requests at once, and a
        complete group is scored while the others generate."""
        super().__init__(core, prompts_per_step, oversample, filter_groups)
        self.keep = keep
        needs_all = self.generating == prompts_per_step and type(self.filter_groups) is KeepAll
        self.calls = Calls.ROUND if round_calls and needs_all else Calls.GROUP

    async def batch(self, version: int) -> tuple[list[GroupState], dict[str, float]]:
        start, tokens = time.monotonic(), self.core.tokens
        self.core.fill(self.generating)
        self.buffer.drop_stale(version, self.core.busy())
        self.buffer.begin_step()
        await self._generate_until_complete(version)
        await self.core.cut(list(self.core.running), keep=self.keep)
        waited = await self.core.rewards()
        return self._take(version, start, tokens, waited)


class RetractSteps(Strategy):
    """Sync, requests kept inside the engines across steps and weight updates. A request sent more
    than max_staleness versions ago is aborted at the next step and its sample judged for staleness."""

    async def batch(self, version: int) -> tuple[list[GroupState], dict[str, float]]:
        start, tokens = time.monotonic(), self.core.tokens
        self.core.fill(self.generating)
        await self.core.cut(self.core.stale_flights(version), keep=True)  # then judged with the rest:
        self.buffer.drop_stale(version, self.core.busy())
        self.buffer.begin_step()
        await self._generate_until_complete(version)
        waited = await self.core.rewards()
        return self._take(version, start, tokens, waited)

    @contextlib.asynccontextmanager
    async def paused(self, version: int):
        """The live engines pause (keeping their requests, dropping their KV caches) and continue
        afterwards under the new weights."""
        async with _engines_paused(self.pool, "retract"):
            yield


class DeterministicRounds(Strategy):
    """Synchronous rounds in which every unfinished sample generates up to the token budget with its
    own sampling seed (RolloutCore: from the run's seed, the sample's id and its length so far, as
    SGLang's sampling_seed), until prompts_per_step groups are complete. Completions are recorded
    in the buffer's order, whatever order they arrive in."""

    def __init__(
        self,
        core: RolloutCore,
        prompts_per_step: int,
        oversample: float = 1.0,
        filter_groups: KeepAll | None = None,
        round_calls: bool = False,
    ) -> None:
        """round_calls: a round's requests share one call an engine (every round is waited for whole
        and scored after it); else a group's share one."""
        super().__init__(core, prompts_per_step, oversample, filter_groups)
        self.calls = Calls.ROUND if round_calls else Calls.GROUP

    async def batch(self, version: int) -> tuple[list[GroupState], dict[str, float]]:
        start, tokens, waited = time.monotonic(), self.core.tokens, 0.0
        self.core.fill(self.generating)
        self.buffer.drop_stale(version)
        self.buffer.begin_step()
        self.core.rescore()  # (finished samples a checkpoint saved unscored)
        while not self._settled():
            requests = self.buffer.begin_requests()
            if not requests:
                raise RuntimeError("rollout stalled: nothing to generate and too few complete groups")
            tasks = self.core.launch_all(requests, version, self.calls)
            await asyncio.wait(tasks)
            for task in tasks:  # in the buffer's order
                self.core.completed(task)
            self.core.report()
            waited += await self.core.rewards()
        return self._take(version, start, tokens, waited)


class AsyncStream(Strategy):
    """Generation beside training. A producer task keeps ceil(prompts_per_step x oversample) groups
    generating (admission permitting) and records completions and rewards as they come; `batch`
    takes the oldest complete groups, after resetting (or, mask_stale_prefix, keeping for masking)
    those holding tokens older than the version that will train them allows."""

    def __init__(
        self,
        core: RolloutCore,
        prompts_per_step: int,
        oversample: float = 1.0,
        pause_mode: str = "retract",
        filter_groups: KeepAll | None = None,
    ) -> None:
        super().__init__(core, prompts_per_step, oversample, filter_groups)
        self.pause_mode = pause_mode
        self.version = 0
        self.halted = False  # no request goes out (a weight update, a checkpoint)
        self._wake = asyncio.Event()  # something the producer must look at again
        self._progress = asyncio.Event()  # a completion or a reward came in
        self._producer: asyncio.Task | None = None
        self._last = (time.monotonic(), 0)  # the previous batch's time and token count

    def admit(self) -> bool:
        """One more group may start: all queued and generating ones could still be trained within
        max_staleness versions of the engines' version, one batch a version (AReaL's rule). A group
        set aside (rollout.filter_groups) leaves its place to another, within the step's extra rounds."""
        limit = (self.version + self.buffer.max_staleness + 1) * self.prompts_per_step
        held = self.filter_groups.held(self.buffer, self.prompts_per_step)
        return self.buffer.taken + self.buffer.in_flight + held < limit

    async def _produce(self) -> None:
        while True:
            if not self.halted:
                self.core.fill(self.generating, self.admit)
                self.core.launch_idle(self.version)
            self._wake.clear()
            waker = asyncio.ensure_future(self._wake.wait())
            try:
                await self.core.wait(waker)
            finally:
                waker.cancel()
            self.filter_groups.sift(self.buffer)  # (their places admit others at once)
            self._progress.set()

    def _ensure_producer(self) -> None:
        if self._producer is None:
            self._producer = asyncio.create_task(self._produce())
        elif self._producer.done():
            self._producer.result()  # its failure (an engine error, a RolloutError) is the run's
            raise RuntimeError("the rollout producer stopped")

    def _poke(self) -> None:
        self._wake.set()

    async def _to_version(self, version: int) -> None:
        """The engines serve `version` now: requests sent too long ago are cut (their output kept)
        and samples that can no longer be trained within max_staleness are reset."""
        self.version = version
        if not self.buffer.mask_stale_prefix:
            await self.core.cut(self.core.stale_flights(version), keep=True)
            self.buffer.drop_stale(version, self.core.busy())
        self._poke()

    async def batch(self, version: int) -> tuple[list[GroupState], dict[str, float]]:
        start = time.monotonic()
        if version != self.version or self._producer is None:
            await self._to_version(version)
        self._ensure_producer()
        look = True  # the producer looks again at what this version may send
        while True:
            if self.buffer.drop_stale(version, self.core.busy()):
                look = True  # samples to generate again
            if self.filter_groups.sift(self.buffer):
                look = True  # places for other groups
            if self.filter_groups.enough(self.buffer, self.prompts_per_step):
                break
            if look:  # (only then: a poke every round made the two tasks wake each other in a busy loop)
                self._poke()
                look = False
            self._progress.clear()
            progress = asyncio.ensure_future(self._progress.wait())
            try:
                await asyncio.wait([self._producer, progress], return_when=asyncio.FIRST_COMPLETED)
            finally:
                progress.cancel()
            self._ensure_producer()
        groups, stats = self._take(version, *self._last, 0.0)
        self._poke()  # room for more groups under the admission rule
        waited = time.monotonic() - start
        self._last = (time.monotonic(), self.core.tokens)
        stats.update(
            {
                "rollout/batch_wait": waited,
                "rollout/queued_groups": float(self.buffer.complete),
                "rollout/generating_groups": float(self.buffer.generating),
            }
        )
        return groups, stats

    @contextlib.asynccontextmanager
    async def paused(self, version: int):
        """No request goes out; the engines pause in rollout.pause_mode (abort: their requests come
        back with what they have, recorded and continued afterwards; retract and in_place: they
        wait inside the engines) and continue under `version` afterwards."""
        self.halted = True
        try:
            async with _engines_paused(self.pool, self.pause_mode):
                yield
            await self._to_version(version)
        finally:
            self.halted = False
            self._poke()

    async def drain(self) -> None:
        self.halted = True
        await super().drain()

    async def resume(self) -> None:
        self.halted = False
        await super().resume()
        self._poke()

    async def close(self) -> None:
        if self._producer is not None:
            self._producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._producer


@contextlib.asynccontextmanager
async def _engines_paused(pool, mode: str):
    """The live engines paused in `mode` meanwhile (their busy time stops), continued afterwards."""
    pool.set_paused(True)
    await pool.each(lambda client: client.pause(mode))
    try:
        yield
    finally:
        await pool.each(lambda client: client.resume())
        pool.set_paused(False)
