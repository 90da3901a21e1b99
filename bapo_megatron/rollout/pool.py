"""The engines a rollout spreads its requests over: who is alive, who is loaded, how long each was busy.

A request that fails with EngineUnavailable (after the client's retries) marks its engine dead
and is resubmitted to another; dead engines are probed and come back when they answer /health
again, unless they were retired: left out of a weight sync, they no longer hold the policy.

An engine counts as busy while it holds at least one request of ours and is not paused:
`busy_seconds` over a step's wall time is the engines' share of it spent generating, which every
engine (SGLang, the embedded one, a scripted one) gives without exporting metrics of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from bapo_megatron.rollout.client import EngineClient, EngineUnavailable


class EnginePool:
    """Live engines and their load; waits (up to timeout_s) for one to come back when all are down."""

    def __init__(self, clients: list[EngineClient], timeout_s: float = 600.0, probe_s: float = 0.5) -> None:
        if not clients:
            raise ValueError("no engines")
        self.clients = clients
        self.load = dict.fromkeys(range(len(clients)), 0)
        self.dead: set[int] = set()
        self.retired: set[int] = set()  # out of the weight sync for good: never picked or probed again
        self.timeout_s, self.probe_s = timeout_s, probe_s
        self.failures = 0
        self.paused = False
        self._busy, self._since = 0.0, time.monotonic()

    def __len__(self) -> int:
        return len(self.clients)

    def live(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.dead and i not in self.retired]

    def retire(self, index: int) -> None:
        """Engine `index` leaves for good (dead when the weights went out without it)."""
        self._account()
        self.dead.discard(index)
        self.retired.add(index)

    async def pick(self, prefer: int | None = None) -> int:
        """`prefer` when it is alive (the engine holding a continued sample's prefix in its cache),
        else the least-loaded live engine."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if prefer is not None and prefer in self.live():
                return prefer
            live = self.live()
            if live:
                return min(live, key=lambda i: self.load[i])
            for i in list(self.dead):
                if await self.clients[i].health():
                    self.dead.discard(i)
            if len(self.dead) + len(self.retired) < len(self.load):
                continue
            if not self.dead or time.monotonic() > deadline:
                raise EngineUnavailable(
                    f"no engine answered for {self.timeout_s:.0f} s: {[c.base_url for c in self.clients]}"
                )
            await asyncio.sleep(self.probe_s)

    def mark_dead(self, index: int) -> None:
        self._account()
        self.dead.add(index)
        self.failures += 1

    @contextlib.contextmanager
    def holding(self, index: int):
        """A request of ours on engine `index` meanwhile (its load and busy time)."""
        self._account()
        self.load[index] += 1
        try:
            yield self.clients[index]
        finally:
            self._account()
            self.load[index] -= 1

    def set_paused(self, paused: bool) -> None:
        self._account()
        self.paused = paused

    def _account(self) -> None:
        now = time.monotonic()
        if not self.paused:
            busy = sum(1 for i, n in self.load.items() if n > 0 and i in self.live())
            self._busy += busy * (now - self._since)
        self._since = now

    def busy_seconds(self) -> float:
        """Engine-seconds spent holding requests of ours, unpaused, summed over the engines."""
        self._account()
        return self._busy

    async def each(self, call: Callable[[EngineClient], Any], engines: list[int] | None = None) -> None:
        """call(client) on these engines (default: the live ones) at once; one found unavailable is
        marked dead (its requests fail over to another engine)."""

        async def one(index: int) -> None:
            try:
                await call(self.clients[index])
            except EngineUnavailable:
                self.mark_dead(index)

        await asyncio.gather(*(one(i) for i in (self.live() if engines is None else engines)))
