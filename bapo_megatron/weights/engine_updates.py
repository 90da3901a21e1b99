"""Rank 0's weight-update group: which engines take the weights, and what happens when one dies.

    updates = EngineUpdates(cfg.rollout, engines, holders)   # the sender built, the engines joined
    sent = updates.send(buckets, version, flush)            # every member updated (or set aside)
    updates.check(version)                                   # each member serves `version`
    updates.revive(updates.waiting)                          # those back from a death serve again

The group holds the engines that answer (the pool's live ones and those back from a death, which
wait for the weights); it is rebuilt when that changes. An engine that dies during an update
leaves the others with a mix of versions: every member then waits for the weights again, and the
next send gives them anew. Colocated engines share the trainer's GPUs: their memory is released
while the trainer trains (`release_memory`), taken back for the update, and one that dies stops
the run. The membership itself is the pool's (engines/pool.py): live, dead, refitting.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterable

from bapo_megatron.config import RolloutConfig
from bapo_megatron.engines.fleet import Engines
from bapo_megatron.engines.launcher import free_port
from bapo_megatron.errors import RunStopped


class EngineUpdates:
    def __init__(self, cfg: RolloutConfig, engines: Engines, holders=None) -> None:
        from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender

        self.cfg, self.engines, self.loop, self.pool = cfg, engines, engines.loop, engines.pool
        clients = engines.clients
        if cfg.engines.colocate:
            self.sender = TensorWeightSender(clients, engine_tp=cfg.engines.tensor_parallel, holders=holders)
        else:
            host = cfg.sync.host or ("127.0.0.1" if not cfg.engines.urls else socket.getfqdn())
            ranks = [cfg.engines.tensor_parallel] * len(clients)
            timeout = cfg.engines.startup_timeout_s
            self.sender = DistributedWeightSender(clients, ranks, host, free_port(host), timeout_s=timeout)
            self.loop.run(self.sender.connect())
        self.members: list[int] = self.pool.serving()  # the engines in the weight-update group
        self.waiting: list[int] = []  # members given the weights by the last send while they waited for them
        self.released = False  # colocated engines' memory given back (after a batch, before a sync)

    def release_memory(self) -> None:
        """Colocated engines give their memory to the trainer until the next send."""
        if self.cfg.engines.colocate:
            self.loop.run(self.pool.each(lambda client: client.release_memory()))
            self.released = True

    def send(self, buckets: Iterable, version: int, flush: bool) -> int:
        """Every bucket to every member as weight version `version`; bytes sent. Call it with the
        engines paused as the rollout mode wants."""
        self._regroup()
        if self.released:  # colocated: the engines hold no memory since the batch
            self.loop.run(self.pool.each(lambda client: client.resume_memory(["weights"])))
        sent = self._send(buckets, version, flush)
        if self.released:
            self.loop.run(self.pool.each(lambda client: client.resume_memory(["kv_cache", "cuda_graph"])))
            self.released = False
        return sent

    def check(self, version: int) -> None:
        """Each member serves `version` (RunStopped if one serves another); one that no longer
        answers is marked dead (restarted, and sent the weights then). `waiting`: the members that
        took these weights while waiting for them, to be checked and revived."""
        for index in self.loop.run(self.engines.check_version(version, self.members)):
            self.loop.call(self.pool.mark_dead, index)
        self.waiting = [i for i in self.members if i in self.pool.refitting]

    def revive(self, engines: list[int]) -> None:
        """These engines took the current weights and passed the checks: they serve again."""
        for index in engines:
            if index in self.pool.refitting:  # (not dead since)
                print(f"engine {self.engines.clients[index].base_url} has the current weights: it serves again")
                self.loop.call(self.pool.revive, index)

    def _send(self, buckets: Iterable, version: int, flush: bool) -> int:
        from bapo_megatron.weights.sync import WeightSendFailed

        if not self.members:  # no engine answers: the trainer's ranks still gather (they come back to a refit)
            return sum(0 for _ in buckets)
        try:
            return self.sender.send(buckets, str(version), self.loop, flush_cache=flush)
        except WeightSendFailed as err:  # (a refusal too: a restarted engine that lost the group refuses)
            print(f"weight sync of version {version} failed ({err}): the engines get it again before serving")
            self.loop.run(self._set_aside(self.members))
            self.members = []
            return 0

    async def _set_aside(self, members: list[int]) -> None:
        """After a failed update: members that answer wait for the weights again (their requests
        aborted: what they generated before the pause is kept), the others are dead."""

        async def one(index: int) -> None:
            client = self.engines.clients[index]
            if await client.health():
                self.pool.came_back(index)
                with contextlib.suppress(Exception):
                    await client.abort()
            else:
                self.pool.mark_dead(index)

        await asyncio.gather(*(one(i) for i in members))

    def _regroup(self) -> None:
        """A new group when the engines that answer changed (an engine died, or came back)."""
        members = self.pool.serving()
        if members == self.members:
            return
        gone = [self.engines.clients[i].base_url for i in self.members if i not in members]
        if gone and self.cfg.engines.colocate:
            raise RunStopped(f"colocated engine(s) {', '.join(gone)} died: their GPUs' weights cannot be served")
        if gone:
            print(
                f"engine(s) {', '.join(gone)} stopped answering: the weights go to the {len(members)} left", flush=True
            )
        self.members = members
        self.sender.clients = [self.engines.clients[i] for i in members]
        self.sender.engine_ranks = [self.cfg.engines.tensor_parallel] * len(members)
        if members:
            self.loop.run(self.sender.connect())  # the old group is left first (a dead end's refusal ignored)

    def close(self) -> None:
        if hasattr(self.sender, "close"):
            self.loop.run(self.sender.close(), timeout=30)
