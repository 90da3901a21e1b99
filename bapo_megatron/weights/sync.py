"""Trainer -> engine weight sync: over a process group, or by handle when colocated.

DistributedWeightSender (update_weights_from_distributed, NCCL on GPU, gloo on CPU): the
trainer's sending rank is rank 0 of a group it hosts: a TCPStore at (host, port) under
PrefixStore(group_name), which is how SGLang's init_custom_process_group joins (a plain
init_process_group would rendezvous on other keys and hang). Engine i joins at rank_offset
1 + the ranks before it. Each bucket: announce names/dtypes/shapes over HTTP to every engine,
broadcast the bucket while the requests wait (by default as one uint8 tensor of the
tensors' bytes in order, SGLang's load_format "flattened_bucket"; else one broadcast per
tensor), then collect the answers.

TensorWeightSender (update_weights_from_tensor, colocated engines): each bucket travels as
handles to memory this process holds (CUDA IPC, or shared memory on CPU; weights/ipc.py),
one payload per engine TP rank, by default one flattened tensor per bucket. The bucket stays
alive until every engine has answered, by which time the engines have copied it.

Both run the whole sync inside one begin/end weight-update session (SGLang >= 0.5.21) and
set the new weight version on every engine; a failed update still ends the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Iterable

import torch

from bapo_megatron.rollout import protocol
from bapo_megatron.rollout.client import EngineClient
from bapo_megatron.weights import ipc

Bucket = list[tuple[str, torch.Tensor]]


class DistributedWeightSender:
    def __init__(self, clients: list[EngineClient], engine_ranks: list[int], host: str, port: int,
                 group_name: str = protocol.DEFAULT_GROUP, backend: str = "gloo", timeout_s: float = 600.0,
                 flatten: bool = True) -> None:
        if len(clients) != len(engine_ranks):
            raise ValueError("one rank count per engine")
        self.clients, self.engine_ranks = clients, engine_ranks
        self.host, self.port, self.group_name, self.backend = host, port, group_name, backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.flatten = flatten  # one broadcast per bucket (load_format flattened_bucket), not one per tensor
        self.group = None
        self._store = None  # hosted here; must outlive the group's rendezvous

    @property
    def world_size(self) -> int:
        return 1 + sum(self.engine_ranks)

    async def connect(self) -> None:
        """Host the store, ask every engine to join, and build our end of the group."""
        import torch.distributed as dist

        store = dist.TCPStore(self.host, self.port, self.world_size, is_master=True, timeout=self.timeout,
                              wait_for_workers=False)
        prefixed = dist.PrefixStore(self.group_name, store)
        offsets = [1 + sum(self.engine_ranks[:i]) for i in range(len(self.clients))]
        joins = [c.init_weights_update_group(self.host, self.port, off, self.world_size, self.group_name, self.backend)
                 for c, off in zip(self.clients, offsets, strict=True)]
        if self.backend == "nccl":
            make = lambda: dist.ProcessGroupNCCL(prefixed, 0, self.world_size)  # noqa: E731
        else:
            make = lambda: dist.ProcessGroupGloo(prefixed, 0, self.world_size, self.timeout)  # noqa: E731
        self.group, *_ = await asyncio.gather(asyncio.to_thread(make), *joins)
        self._store = store

    async def send(self, buckets: Iterable[Bucket], version: str) -> int:
        """Every bucket to every engine; the engines' weight version becomes `version`. Returns bytes sent."""
        if self.group is None:
            raise RuntimeError("connect() first")
        sent = 0
        async with _session(self.clients):
            for bucket in buckets:
                tensors = [t for _, t in bucket]
                if self.flatten:  # before the engines are told: an unaligned bucket fails here, not in them
                    tensors = [ipc.flattened_bucket(bucket)["flattened_tensor"]]
                names = [n for n, _ in bucket]
                dtypes = [protocol.dtype_name(t.dtype) for _, t in bucket]
                shapes = [list(t.shape) for _, t in bucket]
                answers = asyncio.gather(*(c.update_weights_from_distributed(names, dtypes, shapes, version,
                                                                             self.group_name, self.flatten)
                                           for c in self.clients))
                await asyncio.to_thread(self._broadcast, tensors)
                await answers
                sent += _nbytes(bucket)
        return sent

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            self.group.broadcast(tensor.contiguous(), 0).wait()


class TensorWeightSender:
    """Colocated engines (each of `engine_tp` ranks) loading this process's tensors by handle.

    The sending process must hold every bucket (with PP > 1, gather the stages to it first,
    or use DistributedWeightSender)."""

    def __init__(self, clients: list[EngineClient], engine_tp: int = 1, flatten: bool = True) -> None:
        if not clients:
            raise ValueError("no engines")
        if engine_tp < 1:
            raise ValueError(f"engine_tp must be >= 1, got {engine_tp}")
        self.clients, self.engine_tp, self.flatten = clients, engine_tp, flatten

    async def send(self, buckets: Iterable[Bucket], version: str) -> int:
        """Every bucket to every engine; the engines' weight version becomes `version`. Returns bytes sent."""
        sent = 0
        async with _session(self.clients):
            for bucket in buckets:
                payload = ipc.flattened_bucket(bucket) if self.flatten else list(bucket)
                # one pickle per receiving rank (a CUDA IPC reference each), kept valid until all answered
                with ipc.serialized(payload, self.engine_tp * len(self.clients)) as serialized:
                    await asyncio.gather(*(
                        c.update_weights_from_tensor(serialized[i * self.engine_tp:(i + 1) * self.engine_tp],
                                                     version, self.flatten)
                        for i, c in enumerate(self.clients)))
                sent += _nbytes(bucket)
        return sent


@contextlib.asynccontextmanager
async def _session(clients: list[EngineClient]):
    """One begin/end weight-update session on every engine, ended even when the update fails."""
    await asyncio.gather(*(c.begin_weight_update() for c in clients))
    try:
        yield
    finally:
        await asyncio.gather(*(c.end_weight_update() for c in clients), return_exceptions=True)


def _nbytes(bucket: Bucket) -> int:
    return sum(t.numel() * t.element_size() for _, t in bucket)
