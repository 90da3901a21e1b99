"""Colocated engines on several GPUs (weights/sync.HandleHolders): engine rank g loads handles to
trainer rank g's own copy of each bucket, never rank 0's, also when a rank that holds no engine
shares the buckets' collectives, and when the sender looks one bucket ahead; with engines on
every node, each loads its own node's copy (nodes told apart by GROUP_RANK). On CPU the handles
are shared-memory files named by the writing process, so the test sees whose copy each engine
got; every file is gone after the sync."""

import os
from pathlib import Path

import torch

from tests.dist.launch import run_workers

BUCKETS = 3


def _buckets():
    """The same buckets on every rank, each made after a collective of the whole job (as the
    tensor-parallel gathers that make them are)."""
    import torch.distributed as dist

    for k in range(BUCKETS):
        tick = torch.ones(1)
        dist.all_reduce(tick)
        yield [(f"w{k}", torch.full((4, 3), float(k))), (f"b{k}", torch.arange(5.0) + k + tick.item())]


class Engine:
    """A one-rank engine that loads its payload as the embedded engine does and notes whose files
    it read."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.writers: set[int] = set()

    async def begin_weight_update(self) -> None:
        pass

    async def end_weight_update(self) -> None:
        pass

    async def update_weights_from_tensor(self, serialized, version, flatten, flush_cache) -> None:
        from bapo_megatron.common import ipc

        (payload,) = serialized
        rebuild = ipc.rebuild_shared

        def noted(path, dtype, shape):
            self.writers.add(int(Path(path).name.split("-")[1]))  # bapo-<pid>-<uuid>
            return rebuild(path, dtype, shape)

        ipc.rebuild_shared = noted
        try:
            received = ipc.loads(payload)
        finally:
            ipc.rebuild_shared = rebuild
        self.loaded += [(name, t.clone()) for name, t in (ipc.unflatten(received) if flatten else received)]


def _worker(rank: int, world: int, holders_n: int) -> None:
    import torch.distributed as dist

    from bapo_megatron.common import ipc
    from bapo_megatron.engines.fleet import colocated_servers
    from bapo_megatron.engines.loop import EngineLoop
    from bapo_megatron.weights.sync import HandleHolders, TensorWeightSender, node_layout

    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    holders = HandleHolders(colocated_servers(holders_n, 1, node_layout()))
    before = set(ipc._shm_dir().glob("bapo-*"))
    if rank == 0:
        engines = [Engine() for _ in range(holders_n)]
        sender = TensorWeightSender(engines, engine_tp=1, holders=holders)
        loop = EngineLoop()
        sent = sender.send(_buckets(), "1", loop)  # the holders' gathers on this thread, HTTP on the loop
        loop.close()
        want = [pair for bucket in _buckets_local() for pair in bucket]
        assert sent == sum(t.numel() * t.element_size() for _, t in want)
        for i, engine in enumerate(engines):
            assert engine.writers == {pids[i]}, (i, engine.writers, pids)  # engine i: rank i's copy alone
            assert [n for n, _ in engine.loaded] == [n for n, _ in want]
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.loaded, want, strict=True))
    else:
        holders.hold(_buckets())
    dist.barrier()
    assert set(ipc._shm_dir().glob("bapo-*")) - before == set()  # nothing left behind, on any rank
    for nodes in ([[0, 1], [2]], [[0, 2], [1]]):  # two nodes, ranks in blocks (torchrun) or cyclic (srun)
        _node_handoff(rank, world, nodes)


def _node_handoff(rank: int, world: int, nodes: list[list[int]]) -> None:
    """Engines on every node (engines/fleet.colocated_servers), nodes told apart by GROUP_RANK (as
    torchrun --nnodes sets it): the engine of node m loads the copy of node m's local rank 0, never
    rank 0's; the node's other rank holds none and joins every bucket's collectives."""
    import torch.distributed as dist

    from bapo_megatron.engines.fleet import colocated_servers
    from bapo_megatron.engines.loop import EngineLoop
    from bapo_megatron.weights.sync import HandleHolders, TensorWeightSender, node_layout

    node = next(m for m, ranks in enumerate(nodes) if rank in ranks)
    os.environ.update(GROUP_RANK=str(node), LOCAL_RANK=str(nodes[node].index(rank)))
    layout = node_layout()
    assert layout == nodes, layout
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    servers = colocated_servers(len(nodes), 1, layout)  # one engine a node, on its GPU 0
    holders = HandleHolders(servers)
    if rank == 0:
        engines = [Engine() for _ in servers]
        loop = EngineLoop()
        TensorWeightSender(engines, engine_tp=1, holders=holders).send(_buckets(), "1", loop)
        loop.close()
        want = [pair for bucket in _buckets_local() for pair in bucket]
        for server, engine in zip(servers, engines, strict=True):
            # the engine of node m: the copy of node m's local rank 0, never rank 0's
            assert engine.writers == {pids[nodes[server.node][0]]}, (server, engine.writers, pids)
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.loaded, want, strict=True))
    else:
        holders.hold(_buckets())
    dist.barrier()


def _buckets_local():
    """What _buckets yields, without its collectives (every rank's tick is the world size)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    return [[(f"w{k}", torch.full((4, 3), float(k))), (f"b{k}", torch.arange(5.0) + k + world)] for k in range(BUCKETS)]


def test_each_engine_rank_loads_the_copy_of_the_trainer_rank_on_its_gpu():
    run_workers(_worker, 3, 2)  # rank 2 holds no engine but joins every bucket's collective


def _elsewhere_worker(rank: int, world: int) -> None:
    import socket

    import pytest

    from bapo_megatron.weights.sync import node_layout

    if rank == 1:
        socket.gethostname = lambda: "node002"  # rank 1 alone on another node, yet local rank 1 there
    with pytest.raises(ValueError, match=r"the local ranks on node002 \(node 0\) are \[1\], not 0..0"):
        node_layout()


def test_a_node_whose_local_ranks_do_not_number_its_gpus_is_refused_on_every_rank():
    run_workers(_elsewhere_worker, 2)
