"""Dead engines brought back: restarted when the job started them, waited for when it did not.

    supervisor = Supervisor(pool, servers, max_restarts=3, startup_timeout_s=600)
    await supervisor.start()     # on the driver's loop: watches pool.dead from then on
    ...                          # a dead engine comes back as pool.refitting; the driver sends it
                                 # the weights, checks them and revives it (weights/publish.py)
    await supervisor.close()

An engine the job started (`servers[i]`) that the pool marks dead is killed if still running,
started again with the same command (same port, options and key), and waited for until it
answers /health; then it is refitting, never picked until the driver has sent it the current
weights (a restarted engine starts from the starting weights) and checked its version and,
with rollout.sync.check_every, its log-probs (the anchors' rule: no serving before a refit).
A restart that fails max_restarts times in a row sets pool.error, which stops the run at the
next pick. An engine given by URL (another job's) is polled until it answers, then refits.

Restarts run on the driver's event-loop thread, which lives as long as the driver: the engine's
death signal (common/processes.die_with_parent) belongs to the thread that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from bapo_megatron.engines.launcher import ServerProcess
from bapo_megatron.engines.pool import EnginePool


class Supervisor:
    def __init__(
        self,
        pool: EnginePool,
        servers: list[ServerProcess],
        max_restarts: int = 3,
        startup_timeout_s: float = 600.0,
        restart: bool = True,
        probe_s: float = 0.5,
    ) -> None:
        self.pool, self.servers, self.restart = pool, servers, restart
        self.max_restarts, self.startup_timeout_s, self.probe_s = max_restarts, startup_timeout_s, probe_s
        self.restarts = 0  # engines brought back by a restart, all told (engine/restarts)
        self.failed_in_a_row = dict.fromkeys(range(len(pool)), 0)
        self._task: asyncio.Task | None = None
        self._waiting: set[int] = set()  # another job's engines reported as gone, until they answer

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        while True:
            for index in sorted(self.pool.dead):
                if self.pool.error is None:
                    await self._bring_back(index)
            await asyncio.sleep(self.probe_s)

    async def _bring_back(self, index: int) -> None:
        client = self.pool.clients[index]
        server = self.servers[index] if index < len(self.servers) else None
        if server is None:  # another job's engine: back when it answers
            if index not in self._waiting:
                self._waiting.add(index)
                why = self.pool.why.get(index, "stopped answering")
                print(
                    f"engine {client.base_url} {why}: waiting for it (rollout.engines.wait_s="
                    f"{self.pool.wait_s:g} s with no engine serving stops the run)",
                    file=sys.stderr,
                    flush=True,
                )
            if await client.health():
                self._waiting.discard(index)
                self.pool.came_back(index)
            return
        if not self.restart:
            self.pool.error = f"engine {server.url} stopped answering and cannot be restarted here (colocated)"
            return
        attempt = self.failed_in_a_row[index] + 1
        code = server.process.poll() if server.process is not None else None
        how = f"exit code {code}" if code is not None else "still running"
        why = self.pool.why.get(index, "stopped answering")
        print(
            f"engine {server.url} {why} ({how}): restarting it (attempt {attempt} of "
            f"{self.max_restarts}); it serves again once it has the current weights",
            file=sys.stderr,
            flush=True,
        )
        server.kill()
        server.start()
        if await self._ready(server):
            self.failed_in_a_row[index] = 0
            self.restarts += 1
            self.pool.came_back(index)
            return
        server.kill()
        self.failed_in_a_row[index] = attempt
        if attempt >= self.max_restarts:
            code = server.process.poll() if server.process is not None else None
            self.pool.error = (
                f"engine {server.url} did not come back after {attempt} restarts (rollout.engines.max_restarts; "
                f"last exit code {code}); its log: {server.log_path}"
            )

    async def _ready(self, server: ServerProcess) -> bool:
        client = self.pool.clients[self.servers.index(server)]
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return False
            if await client.health():
                return True
            await asyncio.sleep(0.2)
        return False
