"""Run a function on N local processes; a failure on any rank fails the caller.

By default the workers see no GPU and join over gloo, also on a GPU machine: the dist tier
tests the parallel paths on CPU, and N ranks of NCCL on one GPU would not even start. tests/gpu
asks for device="cuda": one GPU per rank (round robin) and NCCL, as in a real job. CPU workers are
forked from a server that imported torch and Megatron once (multiprocessing's forkserver), each given
the caller's environment and import path as a spawned one would have them: a spawned worker's own
imports took longer than most workers' work."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)


def _entry(
    rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, device: str, parent: tuple | None = None
) -> None:
    if parent is not None:  # forked from the server: the caller's environment and import path, as spawn gives
        environ, path = parent
        os.environ.clear()
        os.environ.update(environ)
        sys.path[:] = path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))  # as torchrun sets them
    backend = "gloo"
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    elif torch.cuda.is_available():
        raise RuntimeError("a CPU worker sees a GPU: CUDA_VISIBLE_DEVICES was not honoured")
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args, device: str = "cpu") -> None:
    """fn(rank, world_size, *args) on `world_size` processes (fn must be importable); device "cpu"
    hides every GPU from them (gloo), "cuda" gives each rank a GPU (NCCL)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}")
    with tempfile.TemporaryDirectory() as tmp, _children_env(CUDA_VISIBLE_DEVICES="" if device == "cpu" else None):
        entry_args = (world_size, os.path.join(tmp, "init"), fn, args, device)
        if device == "cpu":  # forked from a server that imported torch and Megatron once, not spawned
            _start_server()
            entry_args += ((dict(os.environ), list(sys.path)),)
        method = "forkserver" if device == "cpu" else "spawn"
        mp.start_processes(_entry, args=entry_args, nprocs=world_size, join=True, start_method=method)


PRELOAD = ["torch", "torch.distributed", "megatron.core", "bapo_megatron.trainer.policy_trainer", __name__]
"""Imported once by the fork server (a worker's start-up otherwise: ~2 s of CPU each, hundreds a suite)."""


def _start_server() -> None:
    """The fork server of the CPU workers, started (once a process) with CUDA hidden: it and every
    worker forked from it see no GPU; tests/gpu's workers are spawned."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


@contextlib.contextmanager
def _children_env(**values: str | None) -> Iterator[None]:
    """os.environ with `values` set (None: left as it is) while processes are spawned from it."""
    saved = {k: os.environ.get(k) for k, v in values.items() if v is not None}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


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


def each_layout(world: int, names, make_first: Callable[[], None], run_one: Callable[[str], None]) -> None:
    """Several layouts of one world size in one launch (each worker's part): the one-process launch
    makes what they share first (`make_first`), then each layout runs with Megatron's groups made anew."""
    from bapo_megatron.trainer.parallel import destroy_model_parallel

    if world == 1:
        make_first()
    for name in names:
        destroy_model_parallel()
        run_one(name)


def run_by_world(fn: Callable, worlds: dict[str, int], *args) -> None:
    """fn(rank, world_size, *args, names) once per world size, with the names of that size: the
    one-process launch first (it makes what the others share), as each_layout expects."""
    names: dict[int, tuple[str, ...]] = {}
    for name, world in worlds.items():
        names[world] = (*names.get(world, ()), name)
    for world, of_world in sorted(names.items()):
        run_workers(fn, world, *args, of_world)
