"""Tensors by handle, not by value: the payloads of SGLang's update_weights_from_tensor.

Colocated, the engine runs on the trainer's GPUs, so a weight update sends handles to
memory the trainer already holds: a CUDA IPC handle for a GPU tensor, a named shared-memory
segment for a CPU one. The payload is a pickle, as SGLang's MultiprocessingSerializer makes
and reads it (base64 in the HTTP body), of either

- a flattened bucket, load_format "flattened_bucket": {"flattened_tensor": one uint8 tensor
  holding the bucket's bytes in order, "metadata": [FlattenedTensorMetadata(name, shape,
  dtype, start_idx, end_idx, numel), ...]}, or
- a list of (name, tensor) pairs, load_format None.

Two details follow SGLang 0.5.23 without importing it:
- GPU tensors name their device by UUID, not index (its patched rebuild_cuda_tensor maps the
  UUID back), because the engine's CUDA_VISIBLE_DEVICES may number the GPUs differently.
- The metadata class is pickled under SGLang's name
  (sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata), one of the globals its
  SafeUnpickler allows; so is every other global of a GPU payload
  (tests/unit/test_conformance.py checks the list in the wheel).

CPU tensors (the embedded engine's colocated runs; SGLang runs on GPUs) are written once to
a file in /dev/shm that the receiver maps copy-on-write, and the sender removes the files
when the receivers have answered, so nothing outlives an update even if a receiver dies.
(torch's own file_system sharing would start a torch_shm_manager daemon that inherits the
trainer's file descriptors and lives as long as any receiver.) `loads` is the receiving end
for the embedded engine: a restricted unpickler that resolves only these payloads' globals.
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import mmap
import os
import pickle
import re
import stat
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.multiprocessing import reductions

from bapo_megatron.common import protocol

SGLANG_METADATA = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_CUDA_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device, as torch's reduce_tensor orders its arguments


@dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a flattened bucket: SGLang's fields, in SGLang's order."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes (the bucket is uint8)


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """The bucket as one uint8 tensor plus where each tensor lies in it (offsets aligned per dtype)."""
    if not named:
        raise ValueError("an empty bucket")
    tensors = [t.detach() for _, t in named]
    layout = protocol.flattened_layout([t.dtype for t in tensors], [list(t.shape) for t in tensors])
    flat = torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    metadata = [
        FlattenedTensorMetadata(name, t.shape, t.dtype, start, end, end - start)
        for (name, t), (start, end) in zip(named, layout, strict=True)
    ]
    return {"flattened_tensor": flat, "metadata": metadata}


def unflatten(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a received flattened bucket, every entry checked against its size."""
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError("flattened_tensor must be a 1-D uint8 tensor")
    out = []
    for meta in metadata:
        size = meta.shape.numel() * meta.dtype.itemsize
        if meta.end_idx - meta.start_idx != size or not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
            raise ValueError(
                f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) do not hold a "
                f"{meta.dtype} tensor of shape {tuple(meta.shape)} in a bucket of {flat.numel()} bytes"
            )
        out.append((meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return out


class _HandlePickler(pickle._Pickler):
    """Tensors as handles: GPU ones by CUDA IPC (device named by UUID), CPU ones as files in
    shared memory (written once, however many payloads name them)."""

    def __init__(self, file, files: dict[int, tuple[torch.Tensor, Path]]) -> None:
        super().__init__(file, protocol=4)
        self.files = files

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu":
                path = str(self._file_of(obj)) if obj.numel() else ""
                return rebuild_shared, (path, protocol.dtype_name(obj.dtype), list(obj.shape))
            obj = obj.detach()
            rebuild, args = reductions.reduce_tensor(obj)
            if obj.is_cuda:
                device = args[_CUDA_DEVICE_ARG]
                args = (
                    *args[:_CUDA_DEVICE_ARG],
                    str(torch.cuda.get_device_properties(device).uuid),
                    *args[_CUDA_DEVICE_ARG + 1 :],
                )
            return rebuild, args
        return NotImplemented

    def _file_of(self, tensor: torch.Tensor) -> Path:
        if id(tensor) not in self.files:
            path = _shm_dir() / f"bapo-{os.getpid()}-{uuid.uuid4().hex}"
            with open(path, "wb") as f:
                f.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            self.files[id(tensor)] = (tensor, path)  # the tensor is kept so that its id stays its own
        return self.files[id(tensor)][1]

    def save_global(self, obj, name=None):
        if obj is FlattenedTensorMetadata:  # SGLang's class, which this process need not have
            self.save(SGLANG_METADATA[0])
            self.save(SGLANG_METADATA[1])
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


_SHARED_NAME = re.compile(r"bapo-\d+-[0-9a-f]{32}")


def rebuild_shared(path: str, dtype: str, shape: list[int]) -> torch.Tensor:
    """A CPU tensor from a payload's shared-memory file, mapped copy-on-write (the sender removes the
    file once the receiver has answered). Only files this module writes can be named: by name, in
    the shared-memory directory, opened without following a link, a regular file owned by this
    user, of exactly the tensor's size."""
    if not isinstance(shape, list | tuple) or not all(type(d) is int and d >= 0 for d in shape):
        raise pickle.UnpicklingError(f"shape {shape!r:.200}: not a list of sizes >= 0")
    dtype_, numel = protocol.torch_dtype(dtype), math.prod(shape)
    if numel == 0 and not path:
        return torch.empty(shape, dtype=dtype_)
    file = Path(path)
    if file.parent != _shm_dir() or not _SHARED_NAME.fullmatch(file.name):
        raise pickle.UnpicklingError(f"{path}: not a weight-payload file")
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as err:  # ELOOP: a symbolic link
        raise pickle.UnpicklingError(f"{path}: cannot open it as a weight-payload file ({err.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise pickle.UnpicklingError(f"{path}: not a regular file of this user")
        if info.st_size != numel * dtype_.itemsize:
            raise pickle.UnpicklingError(f"{path}: {info.st_size} bytes, not a {dtype} tensor of shape {shape}")
        mapped = mmap.mmap(fd, info.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=dtype_).reshape(shape)  # the tensor keeps the mapping alive


@contextlib.contextmanager
def serialized(payload, copies: int = 1) -> Iterator[list[str]]:
    """`copies` payloads as SGLang reads them from HTTP (base64 pickles), one per receiving rank
    (with CUDA IPC each pickle is one reference, released when that rank loads it). Shared-memory
    files of CPU tensors are removed when the block ends: keep it open until the receivers answer."""
    files: dict[int, tuple[torch.Tensor, Path]] = {}
    try:
        out = []
        for _ in range(copies):
            buf = io.BytesIO()
            _HandlePickler(buf, files).dump(payload)
            out.append(base64.b64encode(buf.getvalue()).decode("ascii"))
        yield out
    finally:
        for _, path in files.values():
            path.unlink(missing_ok=True)


_PAYLOAD_GLOBALS = {(__name__, "rebuild_shared"), ("torch", "Size")}


class _PayloadUnpickler(pickle.Unpickler):
    """Resolves only the globals of CPU payloads (shared-memory tensors, torch.Size, dtypes, the metadata)."""

    def find_class(self, module, name):
        if (module, name) == SGLANG_METADATA:
            return FlattenedTensorMetadata
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _PAYLOAD_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"weight payload refers to {module}.{name}, which is not allowed")


def loads(data: str | bytes):
    """A CPU payload made by `serialized` back as tensors. Anything but shared-memory tensors and
    plain data is refused, so a payload cannot run code or read other files, nor make this process
    allocate more than the payload's own size: a payload that is neither text nor bytes is refused
    before anything is allocated (bytes(n) of a JSON integer n would allocate n bytes)."""
    if isinstance(data, str):
        raw = base64.b64decode(data, validate=True)
    elif isinstance(data, bytes | bytearray | memoryview):
        raw = bytes(data)
    else:
        raise TypeError(f"a weight payload is a base64 string or bytes, not {type(data).__name__}")
    _check_lengths(raw)
    return _PayloadUnpickler(io.BytesIO(raw)).load()


def _check_lengths(raw: bytes) -> None:
    """UnpicklingError unless every length the pickle declares (of a byte string, a text, a frame) is
    there in `raw`: the unpickler allocates a byte string's declared length before reading it, so a
    payload of 20 bytes declaring 10^12 would be a MemoryError. pickletools reads each argument
    with read(n) on the payload, which returns what is there, and refuses a short one."""
    import pickletools

    try:
        for _ in pickletools.genops(raw):
            pass
    except ValueError as err:  # a short argument, an unknown opcode, no STOP
        raise pickle.UnpicklingError(f"not a whole pickle: {err}") from None
