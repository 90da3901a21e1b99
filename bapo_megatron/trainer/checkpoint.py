"""Megatron dist checkpoints (torch_dist): written to a temporary directory, renamed, then `latest`.

A kill during a save never leaves a broken `latest`: the step directory appears under its
final name only once complete, and the pointer file is replaced atomically afterwards.
Checkpoints store sharded tensors by global name, so they load at any TP/PP layout.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import warnings
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from bapo_megatron.config import CheckpointConfig
from bapo_megatron.weights.layout import EXTRA_STATE

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict:
    """Every chunk's sharded tensors (global names, so any layout can read them back)."""
    return {f"chunk{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a DDP wrapper (or the module itself)."""
    return getattr(chunk, "module", chunk)


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def in_process_results_queue() -> None:
    """Let torch_dist report write results through a plain in-process queue.

    Its writer creates, on first use, a module-level spawn-context Manager queue: a second
    Python process that imports our main module again (seconds, once per process), needed
    only for asynchronous saves. Ours are synchronous and in this process. Pinned to
    megatron-core 0.16.1 (tests/unit/test_cpu_shim.py has the canary).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_sharded(
    sharded: dict, directory: str | Path, strategy=None, extra_files: dict[str, str] | None = None
) -> None:
    """dist_checkpointing.save into `directory` through a temporary sibling, renamed when complete,
    with `extra_files` (name -> text) written beside it first; `strategy`: a sharded save strategy
    other than Megatron's default torch_dist one."""
    from megatron.core import dist_checkpointing

    in_process_results_queue()
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if _rank0():
        if directory.exists():
            raise FileExistsError(f"checkpoint {directory} exists already; refusing to overwrite it")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        dist_checkpointing.save(sharded, str(tmp), sharded_strategy=strategy)
    except BaseException:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier()
    if _rank0():
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        os.replace(tmp, directory)
    _barrier()


# EXTRA_STATE: Transformer Engine modules' own state (fp8 scaling history). A checkpoint written
# without TE (the converters, a local-spec run) has none: where the loading model asks for it, it
# is left as the model made it, as at the start of a run.


def load_sharded(sharded: dict, directory: str | Path) -> dict:
    """The tensors of `directory` for the shards this rank's `sharded` dict asks for; a requested
    `_extra_state` the checkpoint lacks is left out of the result, anything else missing raises."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        raise ValueError(f"checkpoint {directory}: not a complete dist checkpoint (no metadata.json)")
    loaded, _, absent = dist_checkpointing.load(sharded, str(directory), strict=StrictHandling.RETURN_UNEXPECTED)
    required = sorted(k for k in absent if not k.endswith(EXTRA_STATE))
    if required:
        raise ValueError(
            f"checkpoint {directory} lacks {len(required)} tensors this model needs, e.g. "
            f"{required[:3]} (a checkpoint of another model or layout?)"
        )
    return loaded


def load_module_state(module: torch.nn.Module, state: dict, source: str | Path) -> None:
    """load_state_dict where only TE's `_extra_state` may be absent from `state`."""
    result = module.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {source} does not fit the model: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )


def save_model(model_chunks: list[torch.nn.Module], directory: str | Path) -> None:
    save_sharded(model_sharded_state_dict(model_chunks), directory)


def load_model(model_chunks: list[torch.nn.Module], directory: str | Path) -> None:
    loaded = load_sharded(model_sharded_state_dict(model_chunks), directory)
    for i, chunk in enumerate(model_chunks):
        load_module_state(unwrap(chunk), loaded[f"chunk{i}"], directory)


def _rng_states() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["cpu"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


class CheckpointManager:
    """Save and resume a trainer: model, optimizer, LR schedule, RNG, step and registered extras.

    Layout: DIR/step_00000012/ (a dist checkpoint) and DIR/latest (the name of the newest
    complete one). Extras are objects with state_dict()/load_state_dict() that the driver
    registers (rollout buffer, data cursor); their state is saved by rank 0.
    """

    def __init__(self, cfg: CheckpointConfig, config_yaml: str = "") -> None:
        if cfg.dir is None:
            raise ValueError("CheckpointManager needs checkpoint.dir")
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.config_yaml = config_yaml
        self.extras: dict[str, Stateful] = {}

    def register(self, name: str, obj: Stateful) -> None:
        self.extras[name] = obj

    def _sharded(self, trainer, is_loading: bool, with_rng: bool) -> dict:
        model_sd = model_sharded_state_dict(trainer.model)
        sharded = {
            "model": model_sd,
            "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        }
        if with_rng:
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            rank, world = dist.get_rank(), dist.get_world_size()
            sharded["rng"] = ShardedObject("rng_state", _rng_states(), (world,), (rank,), replica_id=0)
        return sharded

    def save(self, trainer) -> Path:
        """Write step_<N> through a temporary directory, then point `latest` at it, then prune."""
        directory = self.root / f"step_{trainer.step:08d}"
        sharded = self._sharded(trainer, is_loading=False, with_rng=True)
        sharded["common"] = {
            "step": trainer.step,
            "world_size": dist.get_world_size(),
            "scheduler": trainer.scheduler.state_dict(),
            "extras": {name: obj.state_dict() for name, obj in self.extras.items()},
            "config": self.config_yaml,
        }
        save_sharded(sharded, directory)
        if _rank0():
            tmp = self.root / (LATEST + ".tmp")
            tmp.write_text(directory.name + "\n")
            os.replace(tmp, self.root / LATEST)
            self._prune()
        _barrier()
        return directory

    def _prune(self) -> None:
        steps = sorted(p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name))
        for old in steps[: -self.cfg.keep_last]:
            shutil.rmtree(old)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, None when there is none; ValueError when `latest` is broken."""
        pointer = self.root / LATEST
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        directory = self.root / name
        if not STEP_DIR.match(name) or not (directory / "metadata.json").is_file():
            raise ValueError(f"checkpoint pointer {pointer} names {name!r}, which is not a complete checkpoint")
        return directory

    def load(self, trainer, directory: str | Path | None = None) -> int | None:
        """Restore everything from `directory` (default: latest); the step it resumes at, or None."""
        from megatron.core import dist_checkpointing

        directory = Path(directory) if directory is not None else self.latest()
        if directory is None:
            return None
        common = dist_checkpointing.load_common_state_dict(str(directory))["common"]
        same_world = common["world_size"] == dist.get_world_size()
        loaded = load_sharded(self._sharded(trainer, is_loading=True, with_rng=same_world), directory)
        for i, chunk in enumerate(trainer.model):
            load_module_state(unwrap(chunk), loaded["model"][f"chunk{i}"], directory)
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        trainer.scheduler.load_state_dict(common["scheduler"])
        if same_world:
            _set_rng_states(loaded["rng"])
        else:
            warnings.warn(
                f"checkpoint {directory} was saved by {common['world_size']} ranks, this job has "
                f"{dist.get_world_size()}: random states start afresh",
                stacklevel=2,
            )
        for name, obj in self.extras.items():
            if name not in common["extras"]:
                raise ValueError(f"checkpoint {directory} has no state for {name!r}")
            obj.load_state_dict(common["extras"][name])
        trainer.step = common["step"]
        return trainer.step
