"""A torch DCP checkpoint's tensor regions (Megatron's torch_dist format), read with no model, no
process group and no pickle: the reader under mcore-to-hf (weights/mcore_io.py)."""

from __future__ import annotations

import io
import math
import pickle
import struct
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from bapo_megatron.errors import inside
from bapo_megatron.trainer.integrity import check_storage
from bapo_megatron.trainer.safe_load import METADATA_FILE


class StoredChunks:
    """The tensor chunks of a torch DCP checkpoint, read from memory-mapped files.

    DCP stores each chunk as a torch.save archive (an uncompressed zip) at an offset in a
    .distcp file. A chunk stored plainly (one contiguous storage holding exactly the chunk,
    little-endian) is used in place: a view of the mapped file, or one copy when its bytes
    are not aligned to its dtype. Any other chunk is loaded with torch.load(weights_only=True).
    The archive's pickle is read by an unpickler that resolves nothing but the tensor rebuild
    call, never by pickle itself.
    """

    def __init__(self, directory: Path, metadata) -> None:
        self.dir = directory
        self.chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], object]]] = {}
        try:
            for key, md in metadata.state_dict_metadata.items():
                if hasattr(md, "chunks"):
                    self.chunks[key] = [
                        (tuple(c.offsets), tuple(c.sizes), metadata.storage_data[MetadataIndex(key, c.offsets)])
                        for c in md.chunks
                    ]
        except KeyError as err:
            raise ValueError(f"{directory}: checkpoint metadata names no storage for a chunk of {err}") from None
        check_storage(directory, metadata)
        self._files: dict[str, torch.Tensor] = {}
        self._starts: dict[tuple[str, tuple[int, ...]], int | None] = {}

    def check(self, key: str, dtype: torch.dtype) -> None:
        """Each stored chunk of `key` is a readable record of a `dtype` tensor of its shape: a plain
        one's archive is parsed (where its bytes start is kept for the reads), any other loaded."""
        for c_off, c_size, info in self.chunks[key]:
            if self._start(key, c_off, c_size, info, dtype) is None:
                self._chunk(key, c_off, c_size, info, dtype)

    def _overlaps(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[tuple]:
        """(chunk offsets, chunk sizes, storage, overlap start, overlap end) of each stored chunk of `key`
        that overlaps [offsets, offsets + sizes)."""
        for c_off, c_size, info in self.chunks[key]:
            lo = tuple(max(a, b) for a, b in zip(offsets, c_off, strict=True))
            hi = tuple(min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c_off, c_size, strict=True))
            if all(low < high for low, high in zip(lo, hi, strict=True)):
                yield c_off, c_size, info, lo, hi

    def covers(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
        """Whether the stored chunks of `key` (which do not overlap one another) fill the region."""
        if key not in self.chunks:
            return False
        overlap = sum(
            math.prod(high - low for low, high in zip(lo, hi, strict=True))
            for *_, lo, hi in self._overlaps(key, offsets, sizes)
        )
        return overlap == math.prod(sizes)

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The [offsets, offsets + sizes) region of tensor `key`: a view of the file when one stored
        chunk is exactly that region, else assembled from the chunks it overlaps."""
        offsets, sizes = tuple(offsets), tuple(sizes)
        out, covered = None, 0
        for c_off, c_size, info, lo, hi in self._overlaps(key, offsets, sizes):
            chunk = self._chunk(key, c_off, c_size, info, dtype)
            if c_off == offsets and c_size == sizes:
                return chunk
            if out is None:
                out = torch.empty(sizes, dtype=dtype)
            region = [slice(low - a, high - a) for low, high, a in zip(lo, hi, offsets, strict=True)]
            source = [slice(low - b, high - b) for low, high, b in zip(lo, hi, c_off, strict=True)]
            out[tuple(region)] = chunk[tuple(source)]
            covered += math.prod(high - low for low, high in zip(lo, hi, strict=True))
        if out is None or covered != math.prod(sizes):
            raise ValueError(f"{self.dir}: the stored chunks of {key} do not cover {sizes} at {offsets}")
        return out

    def _file(self, relative: str) -> torch.Tensor:
        if relative not in self._files:
            path = inside(self.dir, relative, self.dir / METADATA_FILE)
            self._files[relative] = torch.from_file(
                str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8
            )
        return self._files[relative]

    def _start(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], info, dtype: torch.dtype
    ) -> int | None:
        """Where the bytes of a plainly stored chunk start in its storage item (None: not plain)."""
        if (key, offsets) not in self._starts:
            blob = self._file(info.relative_path)[info.offset : info.offset + info.length]
            plain = info.transform_descriptors is None
            self._starts[key, offsets] = _plain_tensor_record(blob, sizes, dtype) if plain else None
        return self._starts[key, offsets]

    def _chunk(
        self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], info, dtype: torch.dtype
    ) -> torch.Tensor:
        blob = self._file(info.relative_path)[info.offset : info.offset + info.length]
        nbytes = math.prod(sizes) * dtype.itemsize
        start = self._start(key, offsets, sizes, info, dtype)
        if start is not None:
            raw = blob[start : start + nbytes]
            if raw.storage_offset() % dtype.itemsize:
                raw = raw.clone()
            return raw.view(dtype).view(sizes)
        try:
            tensor = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        except Exception as err:
            raise ValueError(
                f"{self.dir}: chunk of {key} at {offsets} in {info.relative_path} is unreadable ({err})"
            ) from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(sizes) or tensor.dtype != dtype:
            raise ValueError(
                f"{self.dir}: chunk of {key} at {offsets} in {info.relative_path} is not a {dtype} tensor "
                f"of shape {tuple(sizes)}"
            )
        return tensor


class _RecordUnpickler(pickle.Unpickler):
    """Reads a torch.save pickle of one tensor into (storage, offset, size, stride) without
    calling anything: the rebuild function and storage types resolve to recorders/names."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _tensor_record
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid):
        return pid


def _tensor_record(storage, offset, size, stride, *_rest):
    return storage, offset, tuple(size), tuple(stride)


def _plain_tensor_record(blob: torch.Tensor, sizes: tuple[int, ...], dtype: torch.dtype) -> int | None:
    """Where in `blob` (a torch.save archive of one tensor) the tensor's bytes start, when they
    are exactly `sizes` contiguous little-endian elements of `dtype`, stored uncompressed; else None."""
    try:
        archive = zipfile.ZipFile(_BlobFile(blob))
        names = archive.namelist()
        prefix = names[0].split("/")[0] + "/"
        storage, offset, size, stride = _RecordUnpickler(io.BytesIO(archive.read(prefix + "data.pkl"))).load()
        if prefix + "byteorder" in names and archive.read(prefix + "byteorder") != b"little":
            return None
        kind, storage_type, record, _location, numel = storage
        with warnings.catch_warnings():  # the typed storage classes, deprecated, only name the dtype here
            warnings.simplefilter("ignore", UserWarning)
            stored = getattr(torch, storage_type).dtype
        contiguous = tuple(torch.empty(sizes, device="meta").stride())
        if (
            kind != "storage"
            or stored != dtype
            or offset != 0
            or size != tuple(sizes)
            or stride != contiguous
            or numel != math.prod(sizes)
        ):
            return None
        entry = archive.getinfo(prefix + f"data/{record}")
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != numel * dtype.itemsize:
            return None
    except (zipfile.BadZipFile, KeyError, ValueError, TypeError, AttributeError, pickle.UnpicklingError, EOFError):
        return None
    header = blob[entry.header_offset : entry.header_offset + 30].numpy().tobytes()
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = entry.header_offset + 30 + name_len + extra_len
    return start if start + entry.file_size <= blob.numel() else None


class _BlobFile(io.RawIOBase):
    """A seekable, read-only file over a uint8 tensor; a read copies only what it asks for."""

    def __init__(self, blob: torch.Tensor) -> None:
        super().__init__()
        self.blob, self.pos = blob, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.blob.numel()}[whence] + pos
        return self.pos

    def readinto(self, buffer) -> int:
        part = self.blob[self.pos : self.pos + len(buffer)].numpy()
        memoryview(buffer).cast("B")[: part.size] = part
        self.pos += part.size
        return part.size
