"""Megatron dist checkpoints (torch_dist): written to a temporary directory, renamed, then `latest`.

A kill during a save never leaves a broken checkpoint: the step directory appears under its
final name only once complete (its files checksummed, trainer/integrity.py, and fsync'd with
the rename), and the pointer file is replaced atomically afterwards. A kill between the two
costs nothing: on start the newest complete step directory wins over a stale `latest`, which
is repaired. Directories are named by the driver's step (not the optimizer's, which skipped
updates leave unchanged), pruning never removes the newest, what `latest` names or what was
just written, and a run that would start afresh over existing checkpoints is refused.
Received checkpoints are read without running code from them (trainer/safe_load.py).
Checkpoints store sharded tensors by global name, so they load at any TP/PP layout.
"""

from __future__ import annotations

import errno
import queue
import re
import sys
import warnings
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from bapo_megatron.config import CheckpointConfig
from bapo_megatron.errors import BadInputError, ConfigError, DiskFull
from bapo_megatron.fsutil import publish, remove, temporary_sibling, write_text_atomic
from bapo_megatron.trainer import safe_load
from bapo_megatron.trainer.integrity import (
    CorruptCheckpointError,
    checksums,
    listed_files,
    verify,
    write_checksums,
)
from bapo_megatron.trainer.megatron_config import EXTRA_STATE
from bapo_megatron.trainer.safe_load import UnsafeCheckpointError, read_metadata

LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{8})$")
STALE_TMP = re.compile(r"^\.step_\d{8}\..+\.tmp$")  # a killed save's temporary (fsutil.temporary_sibling)


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
    return _rank() == 0


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


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
    """dist_checkpointing.save into `directory` through a fresh temporary sibling, renamed when
    complete, with `extra_files` (name -> text) written beside it and every file checksummed;
    `strategy`: a sharded save strategy other than Megatron's default torch_dist one."""
    from megatron.core import dist_checkpointing

    in_process_results_queue()
    directory = Path(directory)
    if directory.exists():  # every rank sees the same (shared) filesystem: all refuse together
        raise FileExistsError(f"checkpoint {directory} exists already; refusing to overwrite it")
    check_space(sharded, directory)
    box = [str(temporary_sibling(directory, directory=True)) if _rank0() else None]
    if _world() > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    try:
        dist_checkpointing.save(sharded, str(tmp), sharded_strategy=strategy)
        _barrier()
        mine = checksums(tmp, sorted(p.name for p in tmp.glob(f"__{_rank()}_*.distcp")))  # what this rank wrote
        gathered = [mine]
        if _world() > 1:
            gathered = [None] * _world()
            dist.all_gather_object(gathered, mine)
        if _rank0():
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            entries = {k: v for part in gathered for k, v in part.items()}
            others = [p.name for p in tmp.iterdir() if p.is_file() and p.name not in entries]
            entries.update(checksums(tmp, others))
            write_checksums(tmp, entries)
            publish(tmp, directory)
    except BaseException as err:
        if _rank0():
            remove(tmp)
        if _no_space(err):  # the disk filled meanwhile (another writer): one clear error, nothing left
            raise DiskFull(f"no space left writing checkpoint {directory}; nothing of it was kept") from None
        raise
    _barrier()


def _no_space(err: BaseException, depth: int = 0) -> bool:
    """Whether ENOSPC is behind this error (its causes, and torch's per-rank checkpoint failures)."""
    if err is None or depth > 8:
        return False
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    if isinstance(err, CheckpointException):
        nested = [e[0] if isinstance(e, tuple) else e for e in err.failures.values()]
        if any(isinstance(e, BaseException) and _no_space(e, depth + 1) for e in nested):
            return True
    return _no_space(err.__cause__, depth + 1) or _no_space(err.__context__, depth + 1)


SPACE_MARGIN = 1.05  # the format's own metadata, and what the file system rounds up
"""The free space a save needs: this much times the bytes of the tensors it writes."""


def check_space(sharded: dict, directory: Path) -> None:
    """DiskFull (an OSError, ENOSPC) naming the directory and the bytes needed when its file system cannot hold
    the tensors this save writes (every rank's, summed: one shared file system), before anything
    is written: a full disk is found before a partial checkpoint is, never after."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    mine = sum(
        v.data.numel() * v.data.element_size()
        for v in nested_values(sharded)
        if isinstance(v, ShardedTensor) and v.data is not None and is_main_replica(v.replica_id)
    )
    total = torch.tensor([float(mine)])
    if _world() > 1 and dist.get_backend() == "gloo":
        dist.all_reduce(total)
    elif _world() > 1:
        total = total.cuda()
        dist.all_reduce(total)
    check_free_space(directory, int(total.item() * SPACE_MARGIN), "checkpoint")


def check_free_space(directory: Path, needed: int, what: str) -> None:
    """DiskFull naming `directory` when the file system it will be made on has less than `needed`
    bytes free (checked on its nearest existing ancestor)."""
    import shutil

    parent = Path(directory).parent
    while not parent.exists() and parent != parent.parent:  # (made with the save)
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise DiskFull(
            f"no space for {what} {directory}: it needs about {needed / 2**20:,.1f} MiB, "
            f"{parent} has {free / 2**20:,.1f} MiB free"
        )


# EXTRA_STATE: Transformer Engine modules' own state (fp8 scaling history). A checkpoint written
# without TE (the converters, a local-spec run) has none: where the loading model asks for it, it
# is left as the model made it, as at the start of a run.


def load_sharded(sharded: dict, directory: str | Path) -> dict:
    """The tensors of `directory` for the shards this rank's `sharded` dict asks for; a requested
    `_extra_state` the checkpoint lacks is left out of the request (and of the result)."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not (directory / "metadata.json").is_file():
        raise ValueError(f"checkpoint {directory}: not a complete dist checkpoint (no metadata.json)")
    present = set(read_metadata(directory).state_dict_metadata)
    sharded = _without_absent_extra_states(sharded, present)
    absent = sorted(_requested_keys(sharded) - present)
    if absent:
        raise ValueError(
            f"checkpoint {directory} lacks {len(absent)} tensors this model needs, e.g. {absent[:3]} "
            "(a checkpoint of another model or layout?)"
        )
    safe_load.install()
    try:
        return dist_checkpointing.load(sharded, str(directory))
    except CheckpointException as wrapped:  # DCP's BaseException wrapper: raise what a rank raised
        first = next(iter(wrapped.failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, UnsafeCheckpointError):
            raise UnsafeCheckpointError(f"checkpoint {directory}: {first}") from None
        raise first from None


def _requested_keys(sharded: dict) -> set[str]:
    """The checkpoint keys a sharded state dict reads (tensors by key, objects by unique key)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    keys = set()
    for value in nested_values(sharded):
        if isinstance(value, ShardedObject):
            keys.add(value.unique_key)
        elif isinstance(value, (ShardedTensor, ShardedTensorFactory)):
            keys.add(value.key)
    return keys


def _without_absent_extra_states(sharded, present: set[str]):
    """`sharded` minus the ShardedObjects of `_extra_state` whose keys the checkpoint does not hold."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(sharded, dict):
        out = {}
        for k, v in sharded.items():
            if isinstance(v, ShardedObject) and v.key.endswith(EXTRA_STATE) and v.unique_key not in present:
                continue
            out[k] = _without_absent_extra_states(v, present)
        return out
    if isinstance(sharded, list):
        return [_without_absent_extra_states(v, present) for v in sharded]
    return sharded


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


def verify_on_all_ranks(directory: str | Path) -> None:
    """integrity.verify with the contents' checksums split over the ranks (each reads 1/world of
    the files); every rank raises the same CorruptCheckpointError when any found a problem."""
    files = listed_files(directory)
    problem = None
    try:
        verify(directory, files=files[_rank() :: _world()])
    except CorruptCheckpointError as err:
        problem = str(err)
    problems = [problem]
    if _world() > 1:
        problems = [None] * _world()
        dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if found:
        raise CorruptCheckpointError(found[0])


def load_model(model_chunks: list[torch.nn.Module], directory: str | Path) -> None:
    verify_on_all_ranks(directory)
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


def weights_dir(path: str | Path) -> Path:
    """The dist checkpoint that model.mcore_path names: a run's checkpoint directory (the step its
    `latest` names, read only) or a step / converted directory as it is."""
    root = Path(path)
    if (root / LATEST).exists() or (root / LATEST).is_symlink():
        name = CheckpointManager(CheckpointConfig(dir=str(root)))._pointer()
        return root / name if name else root
    return root


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

    def save(self, trainer, iteration: int | None = None) -> Path:
        """Write step_<iteration> (default: the optimizer step) through a temporary directory, then
        point `latest` at it, then prune. A complete directory of that step already there (a save
        repeated after a kill) counts as done."""
        iteration = trainer.step if iteration is None else iteration
        directory = self.root / f"step_{iteration:08d}"
        if directory.exists():
            if self._iteration_of(directory) != iteration:
                raise FileExistsError(f"checkpoint {directory} exists and is not a complete step {iteration}")
        else:
            sharded = self._sharded(trainer, is_loading=False, with_rng=True)
            sharded["common"] = {
                "step": trainer.step,
                "iteration": iteration,
                "world_size": dist.get_world_size(),
                "scheduler": trainer.scheduler.state_dict(),
                "extras": {name: obj.state_dict() for name, obj in self.extras.items()},
                "config": self.config_yaml,
            }
            save_sharded(sharded, directory)
        if _rank0():
            write_text_atomic(self.root / LATEST, directory.name + "\n")
            self._prune(protect={directory.name})
        _barrier()
        return directory

    @staticmethod
    def _iteration_of(directory: Path) -> int | None:
        from megatron.core import dist_checkpointing

        try:
            verify(directory, check_contents=False)
            common = dist_checkpointing.load_common_state_dict(str(directory))["common"]
        except Exception:
            return None
        return common.get("iteration", common.get("step"))

    def complete_steps(self) -> list[tuple[int, Path]]:
        """(step, directory) of every complete step directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = STEP_DIR.match(path.name)
            if match and path.is_dir() and not path.is_symlink() and (path / "metadata.json").is_file():
                found.append((int(match.group(1)), path))
        return sorted(found)

    def set_aside_incomplete(self) -> list[Path]:
        """Step directories without metadata.json (a save another tool interrupted; ours write to a
        temporary and rename) renamed to step_NNNNNNNN.incomplete[.K] and reported: left in place, a
        resumed run would reach that step, find its name taken and stop there on every resume."""
        moved = []
        if not self.root.is_dir():
            return moved
        for path in sorted(self.root.iterdir()):
            if STEP_DIR.match(path.name) and path.is_dir() and not path.is_symlink():
                if (path / "metadata.json").is_file():
                    continue
                target, k = path.with_name(path.name + ".incomplete"), 1
                while target.exists():
                    target, k = path.with_name(f"{path.name}.incomplete.{k}"), k + 1
                path.rename(target)
                moved.append(target)
                print(
                    f"checkpoint: {path} has no metadata.json (an interrupted save): set aside as {target.name}; "
                    "the run resumes from the newest complete step",
                    file=sys.stderr,
                    flush=True,
                )
        return moved

    def _pointer(self) -> str | None:
        """The step name `latest` holds (None: no pointer); ValueError for one that is not a plain
        file naming a step (its content is never echoed)."""
        pointer = self.root / LATEST
        if pointer.is_symlink():
            raise BadInputError(f"checkpoint pointer {pointer} is a symbolic link; expected a file naming a step")
        if not pointer.exists():
            return None
        if not pointer.is_file() or pointer.stat().st_size > 64:
            raise BadInputError(f"checkpoint pointer {pointer} is not a small file naming a step (step_NNNNNNNN)")
        name = pointer.read_text(errors="replace").strip()
        if not STEP_DIR.match(name):
            raise BadInputError(f"checkpoint pointer {pointer} does not name a step directory (step_NNNNNNNN)")
        return name

    def _prune(self, protect: set[str]) -> None:
        """Keep the newest keep_last steps, what `latest` names and `protect`; drop killed saves' temporaries."""
        steps = self.complete_steps()
        keep = {p.name for _, p in steps[-self.cfg.keep_last :]} | protect
        try:
            named = self._pointer()
        except ValueError:
            named = None
        keep |= {named} if named else set()
        for _, path in steps:
            if path.name not in keep:
                remove(path)
        for path in self.root.iterdir():
            if STALE_TMP.match(path.name) and not path.is_symlink():
                remove(path)

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the newest complete step directory (None: there is none).
        `latest` names it, except after a kill between a step's rename and the pointer's update:
        then the newer directory wins and the pointer is repaired. ValueError when `latest` names
        a step but no complete checkpoint exists."""
        steps = self.complete_steps()
        try:
            named = self._pointer()
        except ValueError as err:
            if not steps:
                raise
            named, problem = None, str(err)
        else:
            problem = f"names {named}" if named else "is missing"
        if not steps:
            if named is not None:
                raise ValueError(
                    f"checkpoint pointer {self.root / LATEST} names {named!r}, which is not a complete "
                    "checkpoint, and there is no other"
                )
            return None
        newest = steps[-1][1]
        if named != newest.name:
            warnings.warn(
                f"checkpoint pointer {self.root / LATEST} {problem}; resuming from the newest complete "
                f"checkpoint {newest.name} and repairing the pointer",
                stacklevel=2,
            )
            if _rank0():
                write_text_atomic(self.root / LATEST, newest.name + "\n")
        return newest

    def check_start(self, resume: bool, rank: int = 0) -> None:
        """ConfigError when a run that would not resume starts in a directory holding checkpoints
        (its saves would mix with theirs, and pruning would choose among both). A resuming run's
        rank 0 sets step directories without metadata.json aside (set_aside_incomplete)."""
        for path in (self.root, *self.root.parents):
            if path.exists() and not path.is_dir():
                where = "is" if path == self.root else f"lies under {path}, which is"
                raise ConfigError("checkpoint.dir", str(self.root), f"{where} a file, not a directory")
        pointer = self.root / LATEST
        if pointer.is_dir() and not pointer.is_symlink():
            raise BadInputError(
                f"checkpoint pointer {pointer} is a directory; expected a file naming a step (step_NNNNNNNN): "
                "move it away (the newest complete step is then resumed)"
            )
        if resume and rank == 0:
            self.set_aside_incomplete()
        steps = self.complete_steps()
        if steps and not resume:
            raise ConfigError(
                "checkpoint.resume",
                False,
                f"{self.root} holds checkpoints (newest {steps[-1][1].name}): resume from them "
                "(checkpoint.resume=true), or point checkpoint.dir at a new directory",
            )

    def load(self, trainer, directory: str | Path | None = None) -> int | None:
        """Restore everything from `directory` (default: latest); the driver step it resumes at
        (the optimizer step for checkpoints written before driver steps were recorded), or None."""
        from megatron.core import dist_checkpointing

        directory = Path(directory) if directory is not None else self.latest()
        if directory is None:
            return None
        verify_on_all_ranks(directory)  # files there, whole and as written, before the slow part starts
        safe_load.install()
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
        return common.get("iteration", common["step"])
