"""Rank 0's weight outlet (weights/publish.Outlet): the weight-update group, which engines take the
weights, what they answer about them, and what happens when one dies.

    updates = EngineUpdates(cfg, engines, supervisor, prompts, paused, wait_readers, holders, adapters)
    metrics = updates.publish(buckets, version)   # the rollout paused, every member updated and checked
    metrics = updates.publish_adapter(base, adapter, version)   # LoRA: the adapter (the base, when due)
    sample = updates.probe(engine)                # the fixed probe answered by one engine (publish.py)
    updates.revive(updates.waiting())             # those back from a death serve again
    updates.release_memory()                      # colocated: the engines' memory to the trainer

The group holds the engines that answer (the pool's live ones and those back from a death, which
wait for the weights); it is rebuilt when that changes. An engine that dies during an update
leaves the others with a mix of versions: every member then waits for the weights again, and the
next send gives them anew. Colocated engines share the trainer's GPUs: their memory is released
while the trainer trains (`release_memory`), taken back for the update, and one that dies stops
the run. The membership itself is the pool's (engines/pool.py): live, dead, refitting. How the
rollout pauses for an update is its strategy's (rollout/strategies.py), handed in by the driver.

With LoRA adapter sync (model.lora.sync adapter) a publish sends the adapter alone (weights/lora_sync.py),
under a name of its version, which the rollout's requests then name (`adapters`, the driver's
rollout/adapters.ServedAdapter); the base goes first at the run's first publish and whenever an engine
waits for the weights (`needs_base`). Colocated engines then keep their weights (the base) while the
trainer trains: only their KV cache and CUDA graphs are released.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import Callable, Iterable

from bapo_megatron.common.batch import Sample
from bapo_megatron.common.protocol import SamplingParams
from bapo_megatron.config import JobConfig
from bapo_megatron.data.prompts import PromptSource
from bapo_megatron.engines.client import EngineUnavailable
from bapo_megatron.engines.fleet import Engines
from bapo_megatron.engines.launcher import free_port
from bapo_megatron.engines.supervisor import Supervisor
from bapo_megatron.errors import RunStopped

PROBE_TOKENS = 16
KEPT_WITH_WEIGHTS = ("kv_cache", "cuda_graph")
"""What of a colocated engine's memory is released while the trainer trains, and taken back after a
sync, beside its weights (with LoRA adapter sync, the weights stay)."""


class EngineUpdates:
    def __init__(
        self,
        cfg: JobConfig,
        engines: Engines,
        supervisor: Supervisor,
        prompts: PromptSource,
        paused: Callable[[int], contextlib.AbstractAsyncContextManager],
        wait_readers: Callable[[], None],
        holders=None,
        adapters=None,
    ) -> None:
        """paused(version): the rollout paused as its mode wants while `version` goes out (on the
        engines' loop); wait_readers(): what still reads the weights an update replaces (a held-out
        evaluation) finished; prompts: the probe asks for the first; holders: weights/sync.HandleHolders
        (colocated on several GPUs); adapters: the rollout's ServedAdapter (rollout/adapters.py), whose
        adapter the probe names and which a LoRA adapter sync updates."""
        from bapo_megatron.weights.sync import DistributedWeightSender, TensorWeightSender

        ro = cfg.rollout
        self.cfg, self.engines, self.loop, self.pool = ro, engines, engines.loop, engines.pool
        self.supervisor, self.prompts, self.paused, self.wait_readers = supervisor, prompts, paused, wait_readers
        clients = engines.clients
        if ro.engines.colocate:
            self.sender = TensorWeightSender(clients, engine_tp=ro.engines.tensor_parallel, holders=holders)
        else:
            host = ro.sync.host or ("127.0.0.1" if not ro.engines.urls else socket.getfqdn())
            ranks = [ro.engines.tensor_parallel] * len(clients)
            timeout = ro.engines.startup_timeout_s
            self.sender = DistributedWeightSender(clients, ranks, host, free_port(host), timeout_s=timeout)
            self.loop.run(self.sender.connect())
        self.flush = not (ro.mode == "async" and ro.pause_mode == "in_place")  # an in-place pause keeps the cache
        self.probe_sampling = SamplingParams(
            max_new_tokens=min(PROBE_TOKENS, ro.sampling.max_new_tokens),
            temperature=ro.sampling.temperature,
            ignore_eos=True,
            sampling_seed=cfg.seed,
        )
        self.members: list[int] = self.pool.serving()  # the engines in the weight-update group
        self._waiting: list[int] = []  # members given the weights by the last send while they waited for them
        self.released = False  # colocated engines' memory given back (after a batch, before a sync)
        self.adapters, self.lora = adapters, _adapter_sync(cfg, engines, adapters)
        self._based = False  # the engines hold the trainer's base (LoRA adapter sync)
        self._busy: tuple[float, float] | None = None  # (time, the engines' busy seconds) at the last publish

    def publish(self, buckets: Iterable, version: int, verify: bool = False) -> dict[str, float]:
        """Every bucket to every engine as weight version `version` (the rollout paused as its mode
        wants meanwhile); each engine's version is then checked. What still reads the weights these
        replace (an evaluation) finishes first. verify: each engine checks every tensor it received
        against the checksum sent with it (weights/sync.WeightsCorrupted when one differs)."""
        self.wait_readers()
        start = time.monotonic()
        self.sender.verify = verify
        with self.loop.context(self.paused(version)):
            sent = self.send(buckets, version, self.flush)
        self.check(version)
        return {
            **({"sync/verified": 1.0} if verify and sent else {}),  # (nothing sent: no engine took part)
            "time/weight_sync": time.monotonic() - start,
            "sync/bytes": float(sent),
            "engine/live": len(self.pool.live()),
            "engine/restarts": float(self.supervisor.restarts),
            **self._idle_share(),
        }

    def needs_base(self) -> bool:
        """(LoRA adapter sync) Whether the next publish sends the base first: none has gone yet, or an
        engine waits for the weights (it came back: restarted, or set aside after a failed update)."""
        return not self._based or bool(self.pool.refitting)

    def publish_adapter(
        self, base: Iterable | None, adapter: Iterable, version: int, verify: bool = False
    ) -> dict[str, float]:
        """LoRA adapter sync: `base` (the base weights' buckets when needs_base() said so, else None)
        as weight version `version`, then `version`'s adapter (its buckets) on every member, which
        new requests name from then on; older adapters no request names are unloaded (the rollout
        paused meanwhile as its mode wants). verify: the engines check the adapter's checksums (and
        an embedded engine the base's)."""
        self.wait_readers()
        start = time.monotonic()
        with self.loop.context(self.paused(version)):
            based = self._send_base(base, version, verify) if base is not None else 0
            if base is None:
                self._regroup()
            sent = self._load_adapter(adapter, version, verify, set_version=base is None)
        self.check(version)
        return {
            **({"sync/verified": 1.0} if verify and self.members else {}),
            "time/weight_sync": time.monotonic() - start,
            "sync/bytes": float(based + sent),
            "sync/adapter_bytes": float(sent),
            "engine/live": len(self.pool.live()),
            "engine/restarts": float(self.supervisor.restarts),
            **self._idle_share(),
        }

    def _send_base(self, base: Iterable, version: int, verify: bool) -> int:
        """The base to every member (SGLang checks no checksums of it: its probe does); what engines
        coming back held before is unloaded or gone."""
        self.lora.forget([i for i in self.pool.serving() if i in self.pool.refitting], self.loop)
        self.sender.verify = verify and self.cfg.engines.kind == "embedded"
        sent = self.send(base, version, self.flush)
        self._based = bool(self.members)  # (none after a failed send: they get it again)
        return sent

    def _load_adapter(self, buckets: Iterable, version: int, verify: bool, set_version: bool) -> int:
        sent, gone = self.lora.load(buckets, version, self.members, self.loop, verify)
        for index in gone:  # restarted, and given the base and the adapter then
            self.loop.call(self.pool.mark_dead, index)
        serving = [i for i in self.members if i not in gone]
        if set_version:  # the base did not change: the engines' weight version says which adapter is new
            for index in self.loop.run(self._set_version(serving, version)):
                self.loop.call(self.pool.mark_dead, index)
        self.loop.call(self.adapters.serve, version)
        self.lora.unload_unused(serving, self.loop)
        self._resume_released()
        return sent

    async def _set_version(self, engines: list[int], version: int) -> list[int]:
        """Each engine's weight version set to `version`; those that did not answer."""
        clients = [self.engines.clients[i] for i in engines]
        results = await asyncio.gather(
            *(c.update_weight_version(str(version)) for c in clients), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, EngineUnavailable):
                raise result
        return [i for i, r in zip(engines, results, strict=True) if isinstance(r, EngineUnavailable)]

    def _idle_share(self) -> dict[str, float]:
        """engine/idle_share: the share of the engines' time since the last publish in which they held
        no request of ours (or were paused): the engines waiting for the trainer."""
        now, busy = time.monotonic(), self.pool.busy_seconds()
        last, self._busy = self._busy, (now, busy)
        if last is None or now <= last[0]:
            return {}
        return {"engine/idle_share": 1.0 - (busy - last[1]) / (len(self.pool) * (now - last[0]))}

    def probe(self, engine: int | None = None) -> Sample | None:
        """A fixed response (the first prompt, sampled with a fixed seed) with the log-probs of
        engine `engine` (default: a live one). None: no such engine answered (one that did not is
        marked dead: it is restarted, and probed again after its refit; one that answered wrongly is
        also retired, engines/pool.py, and the run stops at too many)."""
        ((ids, _),) = self.prompts.first(1)
        for index in self.pool.live() if engine is None else [engine]:
            client, request = self.engines.clients[index], f"probe-{secrets.token_hex(4)}"
            refitting = index in self.pool.refitting
            try:
                completion = self.loop.run(self._ask(client, list(ids), request))
            except EngineUnavailable as err:  # a wrong answer too: retired, counted toward the run's stop
                self.loop.call(self.pool.failed, index, err, refitting)
                continue
            break
        else:
            return None
        return Sample(
            prompt_ids=list(ids),
            response_ids=completion.output_ids,
            behaviour_logprobs=completion.logprobs,
            versions=[0] * len(completion.output_ids),
            reward=0.0,
            group=0,
        )

    async def _ask(self, client, ids: list[int], request: str):
        """The probe's answer, with the adapter the rollout's requests name (LoRA adapter sync)."""
        if self.adapters is None:
            return await client.generate(ids, self.probe_sampling, request)
        with self.adapters.named() as adapter:
            return await client.generate(ids, self.probe_sampling, request, **adapter.request)

    def waiting(self) -> list[int]:
        """The engines the last publish sent the weights to while they waited for them."""
        return self._waiting

    def release_memory(self) -> None:
        """Colocated engines give their memory to the trainer until the next send (with LoRA adapter
        sync all but their weights: the base they hold is not sent again)."""
        if self.cfg.engines.colocate:
            tags = list(KEPT_WITH_WEIGHTS) if self.lora is not None else None
            self.loop.run(self.pool.each(lambda client: client.release_memory(tags)))
            self.released = True

    def send(self, buckets: Iterable, version: int, flush: bool) -> int:
        """Every bucket to every member as weight version `version`; bytes sent. Call it with the
        engines paused as the rollout mode wants."""
        self._regroup()
        if self.released and self.lora is None:  # colocated: the engines hold no memory since the batch
            self.loop.run(self.pool.each(lambda client: client.resume_memory(["weights"])))
        sent = self._send(buckets, version, flush)
        if self.lora is None:  # (LoRA: after the adapter)
            self._resume_released()
        return sent

    def _resume_released(self) -> None:
        if self.released:
            self.loop.run(self.pool.each(lambda client: client.resume_memory(list(KEPT_WITH_WEIGHTS))))
            self.released = False

    def check(self, version: int) -> None:
        """Each member serves `version` (RunStopped if one serves another); one that no longer
        answers is marked dead (restarted, and sent the weights then). `waiting()`: the members that
        took these weights while waiting for them, to be checked and revived."""
        members = [i for i in self.members if i not in self.pool.dead]  # (an adapter load may find one dead)
        for index in self.loop.run(self.engines.check_version(version, members)):
            self.loop.call(self.pool.mark_dead, index)
        self._waiting = [i for i in self.members if i in self.pool.refitting]

    def revive(self, engines: list[int]) -> int:
        """These engines took the current weights and passed the checks: they serve again (how many)."""
        revived = 0
        for index in engines:
            if index in self.pool.refitting:  # (not dead since)
                print(f"engine {self.engines.clients[index].base_url} has the current weights: it serves again")
                self.loop.call(self.pool.revive, index)
                revived += 1
        return revived

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


def _adapter_sync(cfg: JobConfig, engines: Engines, adapters):
    """weights/lora_sync.AdapterSync with LoRA adapter sync (model.lora.sync adapter), else None."""
    lora = cfg.model.lora
    if not lora.adapter_sync:
        return None
    from bapo_megatron.models.lora import peft_config
    from bapo_megatron.weights.lora_sync import AdapterSync

    if adapters is None:
        raise ValueError("LoRA adapter sync needs the rollout's ServedAdapter (adapters)")
    e = cfg.rollout.engines
    config = peft_config(engines.spec, lora, cfg.model.hf_path)
    return AdapterSync(engines.clients, config, adapters, e.tensor_parallel, by_value=e.kind == "sglang")
