"""Megatron dist checkpoints (torch_dist): written to a temporary directory, renamed, then `latest`.

A kill during a save never leaves a broken `latest`: the step directory appears under its
final name only once complete, and the pointer file is replaced atomically afterwards.
Checkpoints store sharded tensors by global name, so they load at any TP/PP layout.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

LATEST = "latest"


def model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict:
    """Every chunk's sharded tensors (global names, so any layout can read them back)."""
    return {f"chunk{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    return getattr(chunk, "module", chunk)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_sharded(sharded: dict, directory: str | Path) -> None:
    """dist_checkpointing.save into `directory` through a temporary sibling, renamed when complete."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if _rank0():
        if directory.exists():
            raise FileExistsError(f"checkpoint {directory} exists already; refusing to overwrite it")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(sharded, str(tmp))
    _barrier()
    if _rank0():
        os.replace(tmp, directory)
    _barrier()


def load_sharded(sharded: dict, directory: str | Path) -> dict:
    """The tensors of `directory` for the shards this rank's `sharded` dict asks for."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        raise ValueError(f"checkpoint {directory}: not a complete dist checkpoint (no metadata.json)")
    return dist_checkpointing.load(sharded, str(directory))


def save_model(model_chunks: list[torch.nn.Module], directory: str | Path) -> None:
    save_sharded(model_sharded_state_dict(model_chunks), directory)


def load_model(model_chunks: list[torch.nn.Module], directory: str | Path) -> None:
    loaded = load_sharded(model_sharded_state_dict(model_chunks), directory)
    for i, chunk in enumerate(model_chunks):
        _unwrap(chunk).load_state_dict(loaded[f"chunk{i}"])
