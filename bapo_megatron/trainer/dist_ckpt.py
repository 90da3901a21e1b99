"""Megatron dist checkpoint primitives: sharded state saved (checked for space, written to a temporary
directory, checksummed, renamed) and loaded (verified, read without running code from it), the
model's weights alone, and the RNG states; trainer/checkpoint.py's manager builds on them."""

from __future__ import annotations

import errno
import queue
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from bapo_megatron.common.processes import forked_children_die_with_this_process
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.errors import BadInputError, DiskFull, RunStopped
from bapo_megatron.fsutil import publish, remove, temporary_sibling
from bapo_megatron.models.lora import is_adapter
from bapo_megatron.trainer import safe_load
from bapo_megatron.trainer.integrity import (
    CHECKSUMS,
    CorruptCheckpointError,
    checksums,
    listed_files,
    verify_integrity,
    write_checksums,
)
from bapo_megatron.trainer.megatron_config import EXTRA_STATE
from bapo_megatron.trainer.safe_load import UnsafeCheckpointError, read_metadata


def model_sharded_state_dict(model_chunks: list[torch.nn.Module]) -> dict:
    """Every chunk's sharded tensors (global names, so any layout can read them back)."""
    return {f"chunk{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model_chunks)}


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside a DDP wrapper (or the module itself)."""
    return getattr(chunk, "module", chunk)


def is_rank0() -> bool:
    return rank() == 0


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
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


class StreamedFile(Protocol):
    """A file too large to hold in memory that save_sharded's rank 0 writes beside the tensors (the
    kept tensors: trainer/checkpoint.py's CarriedFile)."""

    nbytes: int
    """What it takes on disk: budgeted with the tensors before anything is written."""

    def __call__(self, path: Path) -> dict[str, int] | None:
        """Write it at `path`; its checksum (integrity.file_checksum's) where known without reading it back."""


ExtraFile = str | bytes | StreamedFile


class SaveFailed(OSError, RunStopped):
    """Rank 0 could not write a checkpoint's own files (those beside the tensors, its checksums, the
    rename): every rank raises it with the same message naming the file, and nothing of it is kept."""


def save_sharded(
    sharded: dict,
    directory: str | Path,
    strategy=None,
    extra_files: dict[str, ExtraFile] | None = None,
) -> None:
    """dist_checkpointing.save into `directory` through a fresh temporary sibling, renamed when
    complete, with `extra_files` (rank 0's: name -> text, bytes, or a StreamedFile) written beside it
    and every file checksummed; `strategy`: a sharded save strategy other than Megatron's torch_dist
    one (whose small saves are written without forked writers: save_writers.py). Every rank raises
    when any part failed (rank 0's files: SaveFailed or DiskFull, one message naming the file), and
    then nothing of the checkpoint is left."""
    from megatron.core import dist_checkpointing

    from bapo_megatron.trainer.save_writers import SmallSavesInProcess

    in_process_results_queue()
    forked_children_die_with_this_process()  # the writer processes Megatron forks for the save
    directory, extra_files = Path(directory), extra_files or {}
    if directory.exists():  # every rank sees the same (shared) filesystem: all refuse together
        raise FileExistsError(f"checkpoint {directory} exists already; refusing to overwrite it")
    check_space(sharded, directory, sum(_size(content) for content in extra_files.values()))
    box = [str(temporary_sibling(directory, directory=True)) if is_rank0() else None]
    if world() > 1:
        dist.broadcast_object_list(box, src=0)
    tmp = Path(box[0])
    try:
        dist_checkpointing.save(sharded, str(tmp), sharded_strategy=strategy or SmallSavesInProcess())
        barrier()
        mine = checksums(tmp, sorted(p.name for p in tmp.glob(f"__{rank()}_*.distcp")))  # what this rank wrote
        gathered = [mine]
        if world() > 1:
            gathered = [None] * world()
            dist.all_gather_object(gathered, mine)
    except BaseException as err:
        if is_rank0():
            remove(tmp)
        if _no_space(err):  # the disk filled meanwhile (another writer): one clear error, nothing left
            raise DiskFull(f"no space left writing checkpoint {directory}; nothing of it was kept") from None
        raise
    cause, outcome = _finish(tmp, directory, gathered, extra_files) if is_rank0() else (None, None)
    if world() > 1:  # rank 0's outcome: the others would wait at the barrier below for it to time out
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if outcome is not None:
        no_space, message = outcome
        raise (DiskFull if no_space else SaveFailed)(message) from cause
    barrier()


def _size(content: ExtraFile) -> int:
    if isinstance(content, str):
        content = content.encode()
    return len(content) if isinstance(content, bytes) else content.nbytes


def _finish(
    tmp: Path, directory: Path, gathered: list[dict], extra_files: dict[str, ExtraFile]
) -> tuple[BaseException | None, tuple[bool, str] | None]:
    """Rank 0's part once every rank's tensors are written: the extra files, the checksums, the rename.
    (None, None) when done, else the error and (whether the disk was full, the one-line message) for
    every rank to raise; the temporary is removed then (a real kill leaves it: the next prune drops it)."""
    entries = {k: v for part in gathered for k, v in part.items()}
    try:
        for name, content in extra_files.items():
            doing = f"writing {name}"
            if isinstance(content, str | bytes):
                (tmp / name).write_bytes(content.encode() if isinstance(content, str) else content)
            elif (known := content(tmp / name)) is not None:
                entries[name] = known
        doing = f"writing {CHECKSUMS}"
        others = [p.name for p in tmp.iterdir() if p.is_file() and p.name not in entries]
        entries.update(checksums(tmp, others))
        write_checksums(tmp, entries)
        doing = "renaming it into place"
        publish(tmp, directory)
    except Exception as err:
        remove(tmp)
        if _no_space(err):
            return err, (True, f"no space left writing checkpoint {directory} ({doing}); nothing of it was kept")
        return err, (False, f"checkpoint {directory}: {doing} failed ({err}); nothing of it was kept")
    except BaseException:
        remove(tmp)
        raise
    return None, None


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


def check_space(sharded: dict, directory: Path, extra_bytes: int = 0) -> None:
    """DiskFull (an OSError, ENOSPC) naming the directory and the bytes needed when its file system cannot hold
    the tensors this save writes (every rank's, summed: one shared file system) and the `extra_bytes` of
    the files this rank writes beside them (rank 0's: the kept tensors, a vision tower or an MTP layer of
    gigabytes), before anything is written: a full disk is found before a partial checkpoint is, never after."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    mine = sum(
        v.data.numel() * v.data.element_size()
        for v in nested_values(sharded)
        if isinstance(v, ShardedTensor) and v.data is not None and is_main_replica(v.replica_id)
    )
    total = torch.tensor([float(mine + extra_bytes)])
    if world() > 1 and dist.get_backend() == "gloo":
        dist.all_reduce(total)
    elif world() > 1:
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
    safe_load.install_safe_loaders()
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
        elif isinstance(value, ShardedTensor):
            keys.add(value.key)
        elif isinstance(value, ShardedTensorFactory):  # its tensors' keys: a part's may be its own (GDN's in_proj)
            keys.update(t.key for t in nested_values(value.build()) if isinstance(t, ShardedTensor))
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


def load_module_state(
    module: torch.nn.Module, state: dict, source: str | Path, base_only: bool = False, adapters_only: bool = False
) -> None:
    """load_state_dict where only TE's `_extra_state` may be absent from `state` (and the LoRA
    adapters, with `base_only`, or the base, with `adapters_only`: they keep their values)."""
    result = module.load_state_dict(state, strict=False)
    left = (lambda k: is_adapter(k)) if base_only else (lambda k: not is_adapter(k)) if adapters_only else None
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE) and not (left and left(k))]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {source} does not fit the model: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )


def save_model(model_chunks: list[torch.nn.Module], directory: str | Path) -> None:
    save_sharded(model_sharded_state_dict(model_chunks), directory)


def verify_on_all_ranks(directory: str | Path) -> None:
    """integrity.verify_integrity with the contents' checksums split over the ranks (each reads 1/world of
    the files); every rank raises when any found a problem (a rank that found none: the first
    one's message, as a CorruptCheckpointError), so none is left waiting in a collective."""
    files = listed_files(directory)
    mine = problem = None
    try:
        verify_integrity(directory, files=files[rank() :: world()])
    except BadInputError as err:  # missing, corrupt, or crafted (a name leading outside it, a pickled command)
        mine, problem = err, str(err)
    problems = [problem]
    if world() > 1:
        problems = [None] * world()
        dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if mine is not None:
        raise mine
    if found:
        raise CorruptCheckpointError(found[0])


def load_model(model_chunks: list[torch.nn.Module], directory: str | Path, onto_base: bool = False) -> None:
    """The model's weights from `directory`. A checkpoint without LoRA adapters (a base model's,
    converted) leaves the model's adapters as they are (initialised as PEFT does: the base's outputs);
    one with adapters (a LoRA run's) loads them too; one with the adapters alone loads them `onto_base`
    (the model's base loaded from its source first), and is refused otherwise (it is no model's weights
    without its base)."""
    verify_on_all_ranks(directory)
    sharded = model_sharded_state_dict(model_chunks)
    if not holds_base(sharded, directory) and onto_base:
        loaded = load_sharded(adapters_only(sharded), directory)
        for i, chunk in enumerate(model_chunks):
            load_module_state(unwrap(chunk), loaded[f"chunk{i}"], directory, adapters_only=True)
        return
    if not holds_base(sharded, directory):
        raise ValueError(
            f"checkpoint {directory} holds LoRA adapters alone, without the base they were trained on "
            "(its lora_base.json names it): start from the merged model (tools/convert_checkpoint.py "
            "mcore-to-hf), or resume the run that saved it"
        )
    base_only = not any(is_adapter(key) for key in read_metadata(Path(directory)).state_dict_metadata)
    if base_only:
        sharded = _without_adapters(sharded)
    elif not any(is_adapter(name) for chunk in model_chunks for name, _ in unwrap(chunk).named_parameters()):
        raise ValueError(
            f"checkpoint {directory} holds LoRA adapters and this model has none: set model.lora as the run "
            "that saved it did, or start from its merged model (tools/convert_checkpoint.py mcore-to-hf)"
        )
    loaded = load_sharded(sharded, directory)
    for i, chunk in enumerate(model_chunks):
        load_module_state(unwrap(chunk), loaded[f"chunk{i}"], directory, base_only)


def _without_adapters(sharded: dict) -> dict:
    """`sharded` minus the LoRA adapters' entries."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return _kept(sharded, lambda v: not (isinstance(v, ShardedTensor) and is_adapter(v.key)))


def adapters_only(sharded: dict) -> dict:
    """A model's `sharded` state dict (model_sharded_state_dict's) with its LoRA adapters' tensors and
    the modules' small objects (TE's `_extra_state`) alone: the frozen base's tensors left out (a LoRA
    run whose base is loaded from its source at every start saves no copy of it: 65 GB a save at 32B)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    def keep(v) -> bool:
        return isinstance(v, ShardedObject) or (isinstance(v, ShardedTensor) and is_adapter(v.key))

    return _kept(sharded, keep)


def _kept(sharded: dict, keep) -> dict:
    """`sharded` with the leaves (tensors, factories, objects) `keep` says yes to, nested dicts kept."""
    nested = {k: _kept(v, keep) for k, v in sharded.items() if isinstance(v, dict)}
    return {k: nested.get(k, v) for k, v in sharded.items() if k in nested or keep(v)}


def holds_base(sharded: dict, directory: str | Path) -> bool:
    """Whether the checkpoint at `directory` holds the base tensors of the model whose `sharded` state
    dict is given (False: a LoRA run's checkpoint of the adapters alone). Loading then asks for
    adapters_only(sharded); a checkpoint holding part of the base is load_sharded's to refuse."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    base = _requested_keys(_kept(_without_adapters(sharded), lambda v: not isinstance(v, ShardedObject)))
    present = set(read_metadata(Path(directory)).state_dict_metadata)
    return not base or bool(base & present)


def saved_lora(directory: str | Path) -> LoRAConfig | None:
    """The LoRA adapters' config of the run that saved `directory`, None for a checkpoint without
    adapters; ValueError for one with adapters that does not say how they were made."""
    metadata = read_metadata(Path(directory)).state_dict_metadata
    if not any(k.startswith("decoder.layers.") and is_adapter(k) for k in metadata):
        return None
    lora = saved_model_config(directory).get("lora")
    if not isinstance(lora, dict):
        raise ValueError(f"checkpoint {directory} holds LoRA adapters but its common.pt names no model.lora config")
    return LoRAConfig(**{**lora, "target_modules": tuple(lora["target_modules"])})


def saved_model_config(directory: str | Path) -> dict:
    """The `model` section of the config of the run that saved `directory` (its common.pt's); empty
    for a checkpoint that carries none (a converted one)."""
    import yaml

    config = safe_load.read_common(directory).get("common", {}).get("config") or ""
    model = (yaml.safe_load(config) or {}).get("model")
    return model if isinstance(model, dict) else {}


def rng_states() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    states = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(states["cpu"])
    get_cuda_rng_tracker().set_states(states["tracker"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
