"""safetensors files written tensor by tensor, so that a conversion holds one layer, not a model.

The shapes and dtypes of every tensor are known before the first byte is written (they
follow from config.json), so each file's header is written first and each tensor goes to
its planned offset as soon as it exists, in any order. A file counts as written only when
every planned tensor has arrived exactly once; the caller writes inside an
fsutil.atomic_directory, so an incomplete conversion never appears under its final name.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bapo_megatron.common.progress import Progress

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    # tensors a checkpoint carries untouched (common/hf_io.py KeptSource) keep their own dtypes
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_files(
    entries: Sequence[TensorEntry], max_bytes: int, file_name: Callable[[int, int], str]
) -> list[tuple[str, list[TensorEntry]]]:
    """Entries split, in order, into files of at most max_bytes (a larger tensor gets a file alone),
    the i-th of n named file_name(i, n)."""
    files: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if files[-1] and size + entry.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += entry.nbytes
    return [(file_name(i, len(files)), group) for i, group in enumerate(files)]


class StreamingWriter:
    """Writes planned safetensors files; `write` puts one tensor at its offset, in any order."""

    def __init__(
        self,
        directory: Path,
        files: list[tuple[str, list[TensorEntry]]],
        metadata: dict[str, str] | None = None,
        progress: Progress | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.progress = progress
        self._slots: dict[str, tuple[int, int, TensorEntry]] = {}  # name -> (file index, offset, entry)
        self._handles = []
        self.weight_map: dict[str, str] = {}
        for index, (file, entries) in enumerate(files):
            header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
            offset = 0
            for e in entries:
                if e.dtype not in SAFETENSORS_DTYPES:
                    raise ValueError(f"{e.name}: dtype {e.dtype} cannot be written to safetensors here")
                header[e.name] = {
                    "dtype": SAFETENSORS_DTYPES[e.dtype],
                    "shape": list(e.shape),
                    "data_offsets": [offset, offset + e.nbytes],
                }
                offset += e.nbytes
            blob = json.dumps(header, separators=(",", ":")).encode()
            blob += b" " * (-len(blob) % 8)
            handle = open(self.directory / file, "wb")  # noqa: SIM115 (closed in close())
            handle.write(struct.pack("<Q", len(blob)) + blob)
            start = handle.tell()
            handle.truncate(start + offset)
            self._handles.append(handle)
            position = start
            for e in entries:
                if e.name in self._slots:
                    raise ValueError(f"{e.name} is planned twice")
                self._slots[e.name] = (index, position, e)
                self.weight_map[e.name] = file
                position += e.nbytes
        self._written: set[str] = set()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._slots:
            raise KeyError(f"{name} is not in the planned checkpoint")
        if name in self._written:
            raise RuntimeError(f"{name} written twice")
        index, offset, entry = self._slots[name]
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, planned {entry.shape}")
        tensor = tensor.detach().to(device="cpu", dtype=entry.dtype).contiguous()
        handle = self._handles[index]
        handle.seek(offset)
        handle.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        self._written.add(name)
        if self.progress is not None:
            self.progress.update(entry.nbytes)

    def close(self) -> None:
        """Flush every file to disk (the directory is renamed into place next, so it must be durable)."""
        for handle in self._handles:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        missing = sorted(set(self._slots) - self._written)
        if missing:
            raise RuntimeError(f"{len(missing)} planned tensors were never written, e.g. {missing[0]}")

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for _, _, e in self._slots.values())
