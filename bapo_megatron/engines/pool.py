"""The engines a rollout spreads its requests over: who serves, who is loaded, how long each was busy.

An engine is live, dead or refitting. A request that fails with EngineUnavailable (after the
client's retries) marks its engine dead and is resubmitted to another; so does one the engine
answers wrongly (BadAnswer: engines/client.py), which also retires it: `failed`, for every
request of ours (the rollout's, an evaluation's, the weight probe's). A systematically wrong engine
is no fault a restart mends: the MAX_RETIRED-th retirement of a run stops it, with the last
wrong answer as its one line. A dead engine comes back
(engines/supervisor.py: restarted, or answering again) as refitting: it holds weights that are
not the policy's (a restart's are the starting ones), so it is never picked until the driver
has sent it the current weights and checked them (`revive`). With no live engine, `pick` waits
up to wait_s for one, then stops the run.

An engine counts as busy while it holds at least one request of ours and is not paused:
`busy_seconds` over a step's wall time is the engines' share of it spent generating, which every
engine (SGLang, the embedded one, a scripted one) gives without exporting metrics of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any

from bapo_megatron.engines.client import BadAnswer, EngineClient, EngineUnavailable
from bapo_megatron.errors import RunStopped

MAX_RETIRED = 3
"""Engines retired for a wrong answer that stop a run (the third time, whichever engines answered)."""


class EnginePool:
    """Live engines and their load; waits (up to wait_s) for one to serve when none does."""

    def __init__(self, clients: list[EngineClient], wait_s: float = 900.0, probe_s: float = 0.2) -> None:
        if not clients:
            raise ValueError("no engines")
        self.clients = clients
        self.load = dict.fromkeys(range(len(clients)), 0)
        self.dead: set[int] = set()
        self.refitting: set[int] = set()  # answering again, not yet given the current weights
        self.error: str | None = None  # why no engine can come back (the supervisor's): pick stops the run
        self.wait_s, self.probe_s = wait_s, probe_s
        self.failures = 0
        self.retired = 0  # engines retired for a wrong answer, this run
        self.why: dict[int, str] = {}  # dead engine -> why (what the supervisor says as it brings it back)
        self.paused = False
        self._busy, self._since = 0.0, time.monotonic()

    def __len__(self) -> int:
        return len(self.clients)

    def live(self) -> list[int]:
        return [i for i in range(len(self.clients)) if i not in self.dead and i not in self.refitting]

    def serving(self) -> list[int]:
        """The engines a weight update goes to: the live ones and those waiting for the weights."""
        return [i for i in range(len(self.clients)) if i not in self.dead]

    async def pick(self, prefer: int | None = None) -> int:
        """`prefer` when it is alive (the engine holding a continued sample's prefix in its cache),
        else the least-loaded live engine; with none, waits for one (RunStopped after wait_s)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            if prefer is not None and prefer in self.live():
                return prefer
            live = self.live()
            if live:
                return min(live, key=lambda i: self.load[i])
            if self.error is not None:
                raise RunStopped(self.error)
            if time.monotonic() > deadline:
                raise RunStopped(
                    f"no engine served for {self.wait_s:.0f} s (rollout.engines.wait_s): "
                    f"{self._describe()}; stopping (the last checkpoint is kept)"
                )
            await asyncio.sleep(self.probe_s)

    def _describe(self) -> str:
        def urls(indices) -> str:
            return ", ".join(self.clients[i].base_url for i in sorted(indices)) or "none"

        return f"not answering: {urls(self.dead)}; waiting for the weights: {urls(self.refitting)}"

    def came_back(self, index: int) -> None:
        """Engine `index` answers again (restarted, or back by itself): it waits for the weights."""
        self._account()
        self.dead.discard(index)
        self.refitting.add(index)

    def revive(self, index: int) -> None:
        """Engine `index` holds the current weights (sent and checked): it serves again."""
        self._account()
        self.refitting.discard(index)

    def mark_dead(self, index: int, why: str = "stopped answering") -> None:
        self._account()
        self.refitting.discard(index)
        self.dead.add(index)
        self.why[index] = why
        self.failures += 1

    def failed(self, index: int, err: EngineUnavailable, refitting: bool = False) -> None:
        """A request of ours to engine `index` failed with `err` (whoever sent it: the rollout, an
        evaluation, the weight probe): it is dead, brought back by the supervisor with the current
        weights. A wrong answer (BadAnswer) also retires it, one line naming it and the answer.
        refitting: the request went to it while it waited for the weights (the probe of a refit)."""
        if isinstance(err, BadAnswer):
            self._retire(index, err, refitting)
        else:
            self.mark_dead(index)

    def _retire(self, index: int, answer: BadAnswer, refitting: bool) -> None:
        """Counted toward MAX_RETIRED: RunStopped, with the answer's message, at the run's
        MAX_RETIRED-th retirement (and at every wrong answer after it), since an engine that answers
        wrongly comes back (an external one is never restarted) and would answer so again. Answers
        to requests it held when it was retired, no longer live (or waiting for the weights, as
        asked) since, retire it no further (one fault spoils a whole batch of them)."""
        if self.error is not None:
            raise RunStopped(self.error)
        if index not in (self.refitting if refitting else self.live()):
            return
        self.retired += 1
        if self.retired >= MAX_RETIRED:
            self.error = (
                f"{answer} (the engines answered wrongly {self.retired} times in this run, each time retired "
                "and their requests sent elsewhere: stopping)"
            )
            raise RunStopped(self.error)
        print(
            f"{answer}: retiring {self.clients[index].base_url} ({self.retired} of {MAX_RETIRED} wrong answers "
            "stop the run); its requests go to another engine",
            file=sys.stderr,
            flush=True,
        )
        self.mark_dead(index, "answered wrongly")

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
