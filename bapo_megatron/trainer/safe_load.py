"""Reading a received Megatron dist checkpoint without running code from it.

torch DCP reads a checkpoint's `.metadata` with a plain pickle.load, and its load planner
(Megatron's MCoreLoadPlanner inherits it) reads the byte items of `.distcp` files
(`_extra_state`, `rng_state`, ...) with torch.load(weights_only=False): a crafted checkpoint
would run code in every tool and on resume. Here:
  - `.metadata` is read by a restricted unpickler that resolves only DCP's metadata and save-plan
    classes, torch sizes, dtypes, layouts and memory formats, and OrderedDict (the set found in
    the checkpoints Megatron writes, optimizer and RNG state included);
  - every file `.metadata` stores data in must lie in the checkpoint's directory (errors.inside):
    checked before anything is read;
  - each byte item is first read with torch.load(weights_only=True) (tensors, containers,
    primitives) and handed to Megatron's planner only when that succeeds;
  - `common.pt` is read with torch.load(weights_only=True) and must hold a dict (Megatron reads it
    with torch.load's default, which an environment variable can turn off).
Anything else is refused with an UnsafeCheckpointError naming the file and what it met, in our
words: torch's own message advises loading the file with weights_only=False.

`install_safe_loaders()` puts the reader and the planner into Megatron's torch_dist load strategy (its
module-level reader factory and planner class) and the common.pt reader into its strategy
registry, once per process. Pinned to megatron-core 0.16.1: tests/unit/test_confined_paths.py
fails when those names move.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from bapo_megatron.errors import BadInputError, inside

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    # Megatron keeps the save plans in planner_data
    "torch.distributed.checkpoint.planner": {
        "SavePlan",
        "WriteItem",
        "WriteItemType",
        "TensorWriteData",
        "BytesIOWriteData",
    },
    "torch.serialization": {"_get_layout"},  # how torch.layout pickles: a lookup among torch's layouts
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # storage_meta.checkpoint_id, as some writers record it
    "torch": {"Size"},
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(BadInputError):
    """A checkpoint file holds something other than what this project's checkpoints hold."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)  # torch.float32, torch.strided, torch.contiguous_format, ...
        raise UnsafeCheckpointError(
            f"{self.path}: refers to {module}.{name}, which a checkpoint's metadata never "
            "holds; refusing to load it (a crafted or foreign file?)"
        )


def read_metadata(path: str | Path) -> Metadata:
    """A checkpoint's `.metadata` (the file, or its directory), through the restricted unpickler."""
    path = Path(path)
    if path.is_dir():
        path = path / METADATA_FILE
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # truncated or garbled: pickle raises several types
            raise BadInputError(f"{path}: unreadable checkpoint metadata ({type(err).__name__}: {err})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint metadata")
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"{path}: its storage table is a {type(storage).__name__}, not a mapping")
    for info in storage.values():
        inside(path.parent, getattr(info, "relative_path", None), path)
    return metadata


def not_plain_data(err: Exception) -> str:
    """What torch.load(weights_only=True) refused, without torch's advice to load it unchecked."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    if found:
        return f"it refers to {found.group(1)}"
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in str(err):
        return "it holds objects other than tensors, numbers, strings and containers"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's file reader with `.metadata` read through the restricted unpickler (cached:
    Megatron reads it several times per load)."""

    def __init__(self, path: str | Path, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = read_metadata(Path(str(self.path)) / METADATA_FILE)
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


def _safe_planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class SafeLoadPlanner(MCoreLoadPlanner):
        """Megatron's planner, a byte item passed on only after torch.load(weights_only=True) read it."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except Exception as err:
                info = (self.metadata.storage_data or {}).get(read_item.storage_index)
                where = getattr(info, "relative_path", "a .distcp file")
                raise UnsafeCheckpointError(
                    f"{where}: item {read_item.storage_index.fqn!r} is not plain data, "
                    f"refusing to load it ({not_plain_data(err)})"
                ) from None
            value.seek(0)
            super().load_bytes(read_item, value)

    return SafeLoadPlanner


def read_common(directory: str | Path) -> dict:
    """A checkpoint's common.pt (its state outside the sharded tensors) as plain data."""
    path = Path(directory) / COMMON_FILE
    try:
        common = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as err:  # a crafted pickle, or not a torch.save archive at all
        raise UnsafeCheckpointError(
            f"{path}: not a checkpoint this trainer wrote ({not_plain_data(err)}); refusing to load it"
        ) from None
    if not isinstance(common, dict):
        raise UnsafeCheckpointError(
            f"{path}: not a checkpoint this trainer wrote (it holds a {type(common).__name__}, not a dict)"
        )
    return common


def _safe_common_strategy():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        """Megatron's common.pt reader, through read_common."""

        def load_common(self, checkpoint_dir):
            return read_common(checkpoint_dir)

    return SafeCommonLoadStrategy()


_installed: dict[str, object] = {}


def install_safe_loaders() -> None:
    """Megatron's torch_dist loads read checkpoints through SafeFileSystemReader and SafeLoadPlanner,
    and common.pt (dist_checkpointing.load, load_common_state_dict) through read_common."""
    if _installed:
        return
    from megatron.core.dist_checkpointing.strategies import torch as strategy
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, default_strategies

    _installed["originals"] = (
        strategy._get_filesystem_reader,
        strategy.MCoreLoadPlanner,
        default_strategies[StrategyAction.LOAD_COMMON.value][("torch", 1)],
    )
    strategy._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: SafeFileSystemReader(checkpoint_dir)
    strategy.MCoreLoadPlanner = _safe_planner_class()
    default_strategies[StrategyAction.LOAD_COMMON.value][("torch", 1)] = _safe_common_strategy()
