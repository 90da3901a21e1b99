"""Run a function on N local gloo processes; a failure on any rank fails the caller."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "gather", "scatter", "send", "recv", "isend", "irecv",
)


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # as torchrun sets them
    backend = "gloo"
    if torch.cuda.is_available():  # tests/gpu: one device per rank, NCCL as in a real job
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args) -> None:
    """fn(rank, world_size, *args) on `world_size` processes (fn must be importable)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world_size, os.path.join(tmp, "init"), fn, args), nprocs=world_size, join=True)


@contextlib.contextmanager
def count_collectives() -> Iterator[list[tuple[str, object]]]:
    """Record (name, group) of every torch.distributed collective called inside the block."""
    calls: list[tuple[str, object]] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, original):
        def counted(*args, **kwargs):
            calls.append((name, kwargs.get("group")))
            return original(*args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(dist, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
