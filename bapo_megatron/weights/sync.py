"""Trainer -> engine weight sync: over a process group, or by handle when colocated.

DistributedWeightSender (update_weights_from_distributed; NCCL where CUDA is, gloo on CPU): the
trainer's sending rank is rank 0 of a group built exactly as SGLang builds its end
(common/weight_group.py); rank 0 hosts the rendezvous store at (host, port). Engine i joins at
rank_offset 1 + the ranks before it. Each bucket: announce names/dtypes/shapes over HTTP to
every engine, broadcast the bucket while the requests wait (by default as one uint8 tensor of
the tensors' bytes in order, SGLang's load_format "flattened_bucket"; else one broadcast per
tensor), then collect the answers. After an engine restart, `connect()` again: the old group
is left on both ends first.

TensorWeightSender (update_weights_from_tensor, colocated engines): each bucket travels as
handles to memory the trainer holds (CUDA IPC, or shared memory on CPU; common/ipc.py),
one payload per engine TP rank, by default one flattened tensor per bucket. The bucket stays
alive until every engine has answered, by which time the engines have copied it. With
HandleHolders, each engine rank's payload is the own copy of the trainer rank on its GPU, on
its node (engines on every node: each node's copy goes to its own engines).

With `verify` set (rollout.sync.verify), each bucket's request carries the sha256 of every tensor
as sent (SGLang's expected_checksums); an engine that received other bytes refuses the bucket
before loading it, and the send stops the run (WeightsCorrupted) naming the tensor and the engine.

Both run the whole sync inside one begin/end weight-update session (SGLang >= 0.5.21) and
set the new weight version on every engine; a failed update still ends the session, and so
does a begin that failed on another engine. The engines' caches (prefix KV of the old
weights) are flushed once, with the last bucket, not after every bucket.

`send` runs on the trainer's thread: the buckets' collectives (tensor- and pipeline-parallel
gathers, the holders' gathers) and the broadcasts to the engines stay where the other ranks
run theirs, on the trainer's CUDA device and stream, while the HTTP calls go through the
engines' event loop (engines/loop.py), which keeps the rollout going meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator

import torch

from bapo_megatron.common import ipc, protocol, weight_group
from bapo_megatron.engines.client import (
    CHECKSUM_MISMATCH,
    EngineClient,
    EngineError,
    EngineUnavailable,
    tensor_checksum,
)
from bapo_megatron.engines.launcher import free_port
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.errors import RunStopped

Bucket = list[tuple[str, torch.Tensor]]


def default_backend() -> str:
    """NCCL where this process has CUDA (the buckets are GPU tensors), else gloo."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class DistributedWeightSender:
    def __init__(
        self,
        clients: list[EngineClient],
        engine_ranks: list[int],
        host: str,
        port: int,
        group_name: str = protocol.DEFAULT_GROUP,
        backend: str | None = None,
        timeout_s: float = 600.0,
        flatten: bool = True,
    ) -> None:
        if len(clients) != len(engine_ranks):
            raise ValueError("one rank count per engine")
        if backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend={backend!r}: expected 'nccl' or 'gloo'")
        self.clients, self.engine_ranks = clients, engine_ranks
        self.host, self.port, self.group_name = host, port, group_name
        self.backend = backend or default_backend()
        self.timeout_s = timeout_s
        self.flatten = flatten  # one broadcast per bucket (load_format flattened_bucket), not one per tensor
        self.group = None
        self._joined_before = False
        self.verify = False  # the next sends carry checksums the engines check (rollout.sync.verify)

    @property
    def world_size(self) -> int:
        return 1 + sum(self.engine_ranks)

    async def connect(self) -> None:
        """Ask every engine to join and build our end (rank 0, hosting the store); returns once all
        have joined. Connected already (e.g. after an engine restart): the old group is left first,
        and the new one meets at a port of its own: a store left on the old one (this process shares
        one server per port, multi-tenant) still holds the old group's keys under the same names,
        which a rejoining engine would read, and both ends would wait for ever."""
        if self.group is not None:
            await self.close()
        if self._joined_before:
            self.port = free_port(self.host)
        self._joined_before = True
        offsets = [1 + sum(self.engine_ranks[:i]) for i in range(len(self.clients))]
        ours = asyncio.to_thread(
            weight_group.join_group,
            self.host,
            self.port,
            0,
            self.world_size,
            self.group_name,
            self.backend,
            self.timeout_s,
        )
        joins = [
            c.init_weights_update_group(self.host, self.port, off, self.world_size, self.group_name, self.backend)
            for c, off in zip(self.clients, offsets, strict=True)
        ]
        self.group, *_ = await asyncio.gather(ours, *joins)

    async def close(self) -> None:
        """Leave the group: engines that still hold it destroy theirs (a restarted one has none:
        its refusal is ignored), then this end is destroyed and the group's name is free again."""
        if self.group is None:
            return
        await asyncio.gather(
            *(c.destroy_weights_update_group(self.group_name) for c in self.clients), return_exceptions=True
        )
        weight_group.leave_group(self.group)
        self.group = None

    def send(self, buckets: Iterable[Bucket], version: str, loop: EngineLoop, flush_cache: bool = True) -> int:
        """Every bucket to every engine; the engines' weight version becomes `version`. The buckets are
        made (their collectives run) and broadcast on this thread, the HTTP calls go on `loop`.
        flush_cache: the engines drop their caches after the last bucket (not in an in-place pause,
        where SGLang refuses it while requests keep theirs). Returns bytes sent."""
        if self.group is None:
            raise RuntimeError("connect() first")
        sent, stream = 0, iter(buckets)
        try:
            with _session(self.clients, loop):
                for bucket, last in _mark_last(stream):
                    sent += self._send_bucket(bucket, last, version, loop, flush_cache)
        except WeightsCorrupted:
            self._abandon(loop)
            for _ in stream:
                pass
            raise
        except (RuntimeError, EngineUnavailable, EngineError, TimeoutError) as err:
            # An engine died during the update (its end of the broadcast closed, or it stopped
            # answering), or refused it: leave the group, so that the others' ends fail too instead
            # of waiting for tensors, and make the rest of the buckets (the other ranks gather them
            # with us).
            self._abandon(loop)
            for _ in stream:
                pass
            refused = err if isinstance(err, EngineError) and 400 <= err.status < 500 else None
            kind = WeightsRefused if refused is not None else WeightSendFailed
            raise kind(f"{type(err).__name__}: {str(err)[:300]}") from err
        return sent

    def _send_bucket(self, bucket: Bucket, last: bool, version: str, loop: EngineLoop, flush_cache: bool) -> int:
        tensors = [t for _, t in bucket]
        if self.flatten:  # before the engines are told: an unaligned bucket fails here, not in them
            tensors = [ipc.flattened_bucket(bucket)["flattened_tensor"]]
        names = [n for n, _ in bucket]
        dtypes = [protocol.dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        expected = checksums(bucket) if self.verify else None
        calls = (
            c.update_weights_from_distributed(
                names,
                dtypes,
                shapes,
                version,
                self.group_name,
                self.flatten,
                flush_cache=last and flush_cache,
                **_checks(expected),
            )
            for c in self.clients
        )
        answers = loop.submit(_all(calls))
        try:
            self._broadcast(tensors)
        except BaseException:
            refusal = _refusal(answers, loop)
            answers.cancel()
            if refusal is not None:  # the engine left the group as it refused: its reason is the error
                raise refusal from None
            raise
        _corrupted_or_raise(lambda: loop.wait(answers), version)
        return _nbytes(bucket)

    def _abandon(self, loop: EngineLoop) -> None:
        """After a failed update: our end of the group first (the engines' ends then fail at once),
        then theirs, where they still answer; connect() makes a new one."""
        weight_group.leave_group(self.group)
        self.group = None

        async def destroy() -> None:
            calls = (c.destroy_weights_update_group(self.group_name) for c in self.clients)
            await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

        with contextlib.suppress(Exception):
            loop.run(destroy())

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        for tensor in tensors:  # (on the caller's thread: NCCL's device and stream are the trainer's)
            dist.broadcast(tensor.contiguous(), src=0, group=self.group)


class WeightSendFailed(Exception):
    """A weight update did not reach every engine (one died during it): the engines that took part
    hold a mix of versions and must be sent the weights again before they serve."""


class WeightsRefused(WeightSendFailed):
    """An engine refused the update (4xx, with its reason): names, dtypes or shapes its model cannot
    take, or a group it no longer holds (restarted meanwhile)."""


class WeightsCorrupted(RunStopped):
    """An engine received other bytes than the trainer sent (rollout.sync.verify): the run stops
    rather than train on what it would generate."""


def checksums(bucket: Bucket) -> dict[str, str]:
    """{name: sha256 of the tensor's bytes as sent}: what the engines check their received bucket against."""
    return {name: tensor_checksum(t) for name, t in bucket}


def _checks(expected: dict[str, str] | None) -> dict:
    """The update call's checksum argument, when the send verifies (none otherwise)."""
    return {} if expected is None else {"expected_checksums": expected}


def _corrupted_or_raise(call, version: str):
    """call(); an engine's checksum refusal as WeightsCorrupted, one line naming the engine and the tensor."""
    try:
        return call()
    except EngineError as err:
        text = str(err)
        if CHECKSUM_MISMATCH not in text:
            raise
        detail = text[text.index(CHECKSUM_MISMATCH) :].split('"')[0]
        engine = err.url.rsplit("/", 1)[0]
        raise WeightsCorrupted(
            f"rollout.sync.verify: engine {engine} did not receive the weights of version {version} as sent "
            f"({detail}); stopping rather than train on what it generates"
        ) from None


def _refusal(answers, loop: EngineLoop, seconds: float = 5.0) -> EngineError | None:
    """After a broadcast that failed: an engine's refusal of the update (4xx, its reason), if one
    comes within `seconds` (a refusing engine leaves the group, which is what failed the broadcast)."""
    try:
        loop.wait(answers, timeout=seconds)
    except EngineError as err:
        return err if 400 <= err.status < 500 else None
    except Exception:
        return None
    return None


def _payload(bucket: Bucket, flatten: bool):
    return ipc.flattened_bucket(bucket) if flatten else list(bucket)


def node_layout() -> list[list[int]]:
    """(A collective: every rank.) The global ranks of each node of the job by local rank (LOCAL_RANK,
    its GPU), nodes in the order of their first rank (node 0: rank 0's, the driver's). A node is a
    host and its node rank (torchrun's GROUP_RANK, srun's SLURM_NODEID), so that the nodes of a
    multi-node launch on one machine are told apart. ValueError when a node's local ranks are not
    0..k-1, once each."""
    import os
    import socket

    import torch.distributed as dist

    mine = (socket.gethostname(), os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "0")))
    where: list = [None] * dist.get_world_size()
    dist.all_gather_object(where, (*mine, int(os.environ.get("LOCAL_RANK", "0"))))
    nodes: dict[tuple[str, str], dict[int, int]] = {}
    for rank, (host, node, local) in enumerate(where):
        ranks = nodes.setdefault((host, node), {})
        if local in ranks:
            raise ValueError(f"ranks {ranks[local]} and {rank} are both local rank {local} on {host} (node {node})")
        ranks[local] = rank
    for (host, node), ranks in nodes.items():
        if sorted(ranks) != list(range(len(ranks))):
            raise ValueError(f"the local ranks on {host} (node {node}) are {sorted(ranks)}, not 0..{len(ranks) - 1}")
    return [[ranks[local] for local in range(len(ranks))] for ranks in nodes.values()]


class HandleHolders:
    """Colocated engines on several GPUs, on one node or on every node of the trainer
    (engines/fleet.colocated_servers): engine rank g of a server loads handles to the memory of
    the trainer rank on its GPU, on its own node (CUDA IPC reaches no other node; and one rank's
    copy for every engine rank would make a CUDA context on that GPU in each).

    Every rank of the job makes the model's HF buckets itself (its own tensor- and expert-parallel
    gathers; pipeline_parallel 1: each holder needs the whole model). For each bucket, the holders
    serialize their copy and gather the payloads (handles, not tensors) on rank 0, which hands each
    engine those of its ranks, then lets them drop their copies once the engines have answered.
    Made on every rank of the job at the same point (a process group of the holders)."""

    def __init__(self, servers: list, flatten: bool = True) -> None:
        import torch.distributed as dist

        self.servers = servers  # engines/fleet.ColocatedServer, by engine index
        self.order = [rank for server in servers for rank in server.ranks]  # engine by engine, by TP rank
        self.ranks = sorted(self.order)
        if 0 not in self.ranks or len(set(self.order)) != len(self.order):
            raise ValueError(f"engine ranks {self.order}: rank 0 must hold one, and no rank two")
        self.n, self.flatten, self.rank = len(self.order), flatten, dist.get_rank()
        self.group = dist.new_group(self.ranks)

    @contextlib.contextmanager
    def payloads(self, bucket: Bucket) -> Iterator[list[str]]:
        """(rank 0) Every engine rank's payload of `bucket`, engine by engine: valid until the block ends."""
        import torch.distributed as dist

        with ipc.serialized(_payload(bucket, self.flatten)) as (mine,):
            gathered: list = [None] * self.n
            dist.gather_object(mine, gathered, dst=0, group=self.group)  # by group rank: the sorted ranks
            yield [gathered[self.ranks.index(rank)] for rank in self.order]
            dist.barrier(group=self.group)  # the engines have answered: the holders may let go

    def hold(self, buckets: Iterable[Bucket]) -> None:
        """(every other rank) This rank's buckets: a holder's part of `payloads` for each."""
        import torch.distributed as dist

        # the sender looks one bucket ahead (_mark_last): the next bucket's gathers come before this
        # one's payloads on rank 0, so they must here too
        for bucket, _ in _mark_last(buckets):
            if self.rank in self.ranks:
                with ipc.serialized(_payload(bucket, self.flatten)) as (mine,):
                    dist.gather_object(mine, None, dst=0, group=self.group)
                    dist.barrier(group=self.group)


class TensorWeightSender:
    """Colocated engines (each of `engine_tp` ranks) loading the trainer's tensors by handle.

    The sending process must hold every bucket (with PP > 1, gather the stages to it first,
    or use DistributedWeightSender). Without `holders`, every engine rank gets handles to this
    process's copy; with them, engine rank g gets trainer rank g's."""

    def __init__(
        self,
        clients: list[EngineClient],
        engine_tp: int = 1,
        flatten: bool = True,
        holders: HandleHolders | None = None,
    ) -> None:
        if not clients:
            raise ValueError("no engines")
        if engine_tp < 1:
            raise ValueError(f"engine_tp must be >= 1, got {engine_tp}")
        if holders is not None and holders.n != engine_tp * len(clients):
            raise ValueError(f"{holders.n} holders for {len(clients)} engines of TP {engine_tp}")
        if holders is not None and holders.flatten != flatten:
            raise ValueError(f"the holders make {'flattened' if holders.flatten else 'per-tensor'} payloads")
        self.clients, self.engine_tp, self.flatten, self.holders = clients, engine_tp, flatten, holders
        self.verify = False  # the next sends carry checksums the engines check (rollout.sync.verify)

    def send(self, buckets: Iterable[Bucket], version: str, loop: EngineLoop, flush_cache: bool = True) -> int:
        """Every bucket to every engine; the engines' weight version becomes `version`. The buckets and
        their handles are made on this thread (the holders' collectives), the HTTP calls go on
        `loop`. Returns bytes sent."""
        sent, stream = 0, _mark_last(buckets)
        try:
            with _session(self.clients, loop):
                for bucket, last in stream:
                    sent += self._send_bucket(bucket, version, loop, last and flush_cache)
        except WeightsCorrupted:
            for bucket, _ in stream:  # the other ranks still gather (and hold) the rest with us
                with self._held(bucket):
                    pass
            raise
        return sent

    def _held(self, bucket: Bucket):
        """One pickle per receiving rank (a CUDA IPC reference each), valid until the block ends."""
        if self.holders is not None:
            return self.holders.payloads(bucket)
        return ipc.serialized(_payload(bucket, self.flatten), self.engine_tp * len(self.clients))

    def _send_bucket(self, bucket: Bucket, version: str, loop: EngineLoop, flush_cache: bool) -> int:
        expected = checksums(bucket) if self.verify else None
        with self._held(bucket) as serialized:
            calls = (
                c.update_weights_from_tensor(
                    serialized[i * self.engine_tp : (i + 1) * self.engine_tp],
                    version,
                    self.flatten,
                    flush_cache=flush_cache,
                    **_checks(expected),
                )
                for i, c in enumerate(self.clients)
            )
            _corrupted_or_raise(lambda: loop.run(_all(calls)), version)
        return _nbytes(bucket)


async def _all(calls) -> list:
    return await asyncio.gather(*calls)


@contextlib.contextmanager
def _session(clients: list[EngineClient], loop: EngineLoop):
    """One begin/end weight-update session on every engine, ended even when the update fails or
    when another engine refused to begin (no engine is left with a session open)."""

    async def begin() -> list:
        return await asyncio.gather(*(c.begin_weight_update() for c in clients), return_exceptions=True)

    begun = loop.run(begin())
    failed = [r for r in begun if isinstance(r, BaseException)]
    try:
        if failed:
            raise failed[0]
        yield
    finally:
        opened = [c for c, r in zip(clients, begun, strict=True) if not isinstance(r, BaseException)]
        loop.run(_all_settled(c.end_weight_update() for c in opened))


async def _all_settled(calls) -> list:
    return await asyncio.gather(*calls, return_exceptions=True)


def _mark_last(buckets: Iterable[Bucket]) -> Iterator[tuple[Bucket, bool]]:
    """Each bucket with whether it is the last (one look-ahead: the buckets may be a stream)."""
    it = iter(buckets)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def _nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)
