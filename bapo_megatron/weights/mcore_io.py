"""Megatron dist checkpoints without a model: read one decoder layer at a time as HF tensors,
and written one tensor at a time from tensors made on demand.

dist_checkpointing stores each decoder parameter stacked over layers under one global key
(e.g. `decoder.layers.self_attention.linear_qkv.weight`, shape [layers, ...]) and with
Transformer Engine's names for the two norms, whatever layer spec saved it. Asking it for
one layer's slice reads just that slice, so a conversion holds one layer at a time. Works
on checkpoints written by the converter and by the trainer (their model keys are the same;
optimizer keys are ignored), saved at any TP/PP.

Writing goes through dist_checkpointing.save with StreamingSaveStrategy: the sharded state
dict is a model's, built on the meta device (so the keys, shards and objects are exactly
Megatron's), and each tensor is made when the writer reaches it.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
import warnings
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from bapo_megatron.common.model_spec import ModelSpec
from bapo_megatron.errors import inside
from bapo_megatron.trainer.integrity import check_storage, verify
from bapo_megatron.trainer.safe_load import METADATA_FILE
from bapo_megatron.weights.layout import megatron_layer_to_hf

HF_CONFIG = "hf_config.json"
EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
STORED_IMPL = "transformer_engine"  # the norm names every layer spec saves under


def layer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Per-layer Megatron parameter suffixes (stored names) and their whole (TP=1) shapes."""
    d, hd = spec.hidden_size, spec.head_dim
    qkv_rows = (spec.num_heads + 2 * spec.num_kv_heads) * hd
    shapes = {
        "self_attention.linear_qkv.layer_norm_weight": (d,),
        "self_attention.linear_qkv.weight": (qkv_rows, d),
        "self_attention.linear_proj.weight": (d, spec.num_heads * hd),
        "mlp.linear_fc1.layer_norm_weight": (d,),
        "mlp.linear_fc1.weight": (2 * spec.ffn_hidden_size, d),
        "mlp.linear_fc2.weight": (d, spec.ffn_hidden_size),
    }
    if spec.qkv_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv_rows,)
    return shapes


def read_hf_config(directory: Path, template: Path | None = None) -> dict:
    """The HF config.json a Megatron checkpoint was made from (its hf_config.json, else the template's)."""
    source = directory / HF_CONFIG if (directory / HF_CONFIG).is_file() else None
    if source is None and template is not None:
        source = template / "config.json"
    if source is None or not source.is_file():
        raise ValueError(f"{directory}: no {HF_CONFIG}; pass --hf-template DIR with the model's config.json")
    return json.loads(source.read_text())


class McoreCheckpoint:
    """A validated Megatron dist checkpoint directory of a Qwen2/Llama model; HF tensors on demand.

    Reads the storage under Megatron's torch_dist format (torch DCP) through StoredChunks:
    memory-mapped, one slice at a time, no process group needed.
    """

    def __init__(self, directory: str | Path, template: str | Path | None = None) -> None:
        self.dir = Path(directory)
        if not (self.dir / "metadata.json").is_file():
            raise ValueError(f"{self.dir}: not a complete Megatron dist checkpoint (no metadata.json)")
        self.config = read_hf_config(self.dir, Path(template) if template else None)
        self.spec = ModelSpec.from_hf_config(self.config)
        metadata = verify(self.dir)  # files present, whole, and as written; .metadata read without running code
        self.meta = {
            k: (tuple(m.size), m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if hasattr(m, "size")
        }
        self._check()
        self._chunks = StoredChunks(self.dir, metadata)

    def _check(self) -> None:
        spec = self.spec
        expected = {EMBEDDING: None, FINAL_NORM: (spec.hidden_size,)}
        if not spec.tie_embeddings:
            expected[OUTPUT] = None
        for suffix, shape in layer_shapes(spec).items():
            expected[f"decoder.layers.{suffix}"] = (spec.num_layers, *shape)
        for key, shape in expected.items():
            if key not in self.meta:
                raise ValueError(f"{self.dir}: no tensor {key} (is hf_config.json the config of this model?)")
            got = self.meta[key][0]
            if shape is None:  # vocabulary rows, padded
                if len(got) != 2 or got[1] != spec.hidden_size or got[0] < spec.vocab_size:
                    raise ValueError(
                        f"{self.dir}: {key} has shape {got}, expected (>= {spec.vocab_size}, {spec.hidden_size})"
                    )
            elif got != shape:
                raise ValueError(f"{self.dir}: {key} has shape {got}, the model's config implies {shape}")

    def _load(self, requests: dict[str, tuple[str, int | None]]) -> dict[str, torch.Tensor]:
        """{name: (stored key, layer or None)} -> {name: tensor}; a layer index reads one slice."""
        out = {}
        for name, (key, layer) in requests.items():
            shape, dtype = self.meta[key]
            if layer is None:
                out[name] = self._chunks.read(key, (0,) * len(shape), shape, dtype)
            else:
                out[name] = self._chunks.read(key, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]), dtype)[0]
        return out

    def hf_groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """HF (name -> tensor) groups in loading order: the embedding, each layer, then the final norm
        and untied lm_head. Vocabulary padding trimmed. One group is in memory at a time."""
        vocab = self.spec.vocab_size
        yield {"model.embed_tokens.weight": self._load({"e": (EMBEDDING, None)})["e"][:vocab]}
        suffixes = layer_shapes(self.spec)
        for i in range(self.spec.num_layers):
            stored = self._load({f"decoder.layers.{i}.{s}": (f"decoder.layers.{s}", i) for s in suffixes})
            yield dict(megatron_layer_to_hf(self.spec, i, stored, STORED_IMPL))
        final = {"model.norm.weight": (FINAL_NORM, None)}
        if not self.spec.tie_embeddings:
            final["lm_head.weight"] = (OUTPUT, None)
        tensors = self._load(final)
        if "lm_head.weight" in tensors:
            tensors["lm_head.weight"] = tensors["lm_head.weight"][:vocab]
        yield tensors


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

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The [offsets, offsets + sizes) region of tensor `key`: a view of the file when one stored
        chunk is exactly that region, else assembled from the chunks it overlaps."""
        out, covered = None, 0
        for c_off, c_size, info in self.chunks[key]:
            lo = [max(a, b) for a, b in zip(offsets, c_off, strict=True)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, sizes, c_off, c_size, strict=True)]
            if any(low >= high for low, high in zip(lo, hi, strict=True)):
                continue
            chunk = self._chunk(key, c_size, info, dtype)
            if c_off == tuple(offsets) and c_size == tuple(sizes):
                return chunk
            if out is None:
                out = torch.empty(sizes, dtype=dtype)
            region = [slice(low - a, high - a) for low, high, a in zip(lo, hi, offsets, strict=True)]
            source = [slice(low - b, high - b) for low, high, b in zip(lo, hi, c_off, strict=True)]
            out[tuple(region)] = chunk[tuple(source)]
            covered += math.prod(high - low for low, high in zip(lo, hi, strict=True))
        if out is None or covered != math.prod(sizes):
            raise ValueError(f"{self.dir}: the stored chunks of {key} do not cover {tuple(sizes)} at {tuple(offsets)}")
        return out

    def _file(self, relative: str) -> torch.Tensor:
        if relative not in self._files:
            path = inside(self.dir, relative, self.dir / METADATA_FILE)
            self._files[relative] = torch.from_file(
                str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8
            )
        return self._files[relative]

    def _chunk(self, key: str, sizes: tuple[int, ...], info, dtype: torch.dtype) -> torch.Tensor:
        blob = self._file(info.relative_path)[info.offset : info.offset + info.length]
        nbytes = math.prod(sizes) * dtype.itemsize
        start = _plain_tensor_record(blob, sizes, dtype) if info.transform_descriptors is None else None
        if start is not None:
            raw = blob[start : start + nbytes]
            if raw.storage_offset() % dtype.itemsize:
                raw = raw.clone()
            return raw.view(dtype).view(sizes)
        try:
            tensor = torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)
        except Exception as err:
            raise ValueError(f"{self.dir}: chunk of {key} in {info.relative_path} is unreadable ({err})") from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(sizes) or tensor.dtype != dtype:
            raise ValueError(
                f"{self.dir}: chunk of {key} in {info.relative_path} is not a {dtype} tensor of shape {tuple(sizes)}"
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


def streaming_save_strategy(make: Callable, dtype: torch.dtype, on_tensor: Callable[[int], None] | None = None):
    """A dist_checkpointing sharded save strategy writing Megatron's torch_dist format through torch
    DCP, one tensor at a time: `make(sharded_tensor)` returns each ShardedTensor's data (its
    `data` may be a placeholder, e.g. on the meta device) when the writer reaches it, cast to
    `dtype`; `on_tensor(nbytes)` after each. Peak memory: one tensor, not the model. One
    process writes the whole checkpoint (the converters run as a world of one).

    The files are those of Megatron's own torch_dist strategy: the same DCP keys, chunks and
    metadata, objects saved as Megatron does (torch.save of a one-element list).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy

    default = get_default_save_sharded_strategy()

    class StreamingSaveStrategy(SaveShardedStrategy):
        @property
        def can_handle_sharded_objects(self) -> bool:
            return True

        def save(self, sharded_state_dict, checkpoint_dir) -> None:
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                raise RuntimeError("the streaming save strategy writes from one process (a world of one)")
            tensors, objects = [], []
            for item in nested_values(sharded_state_dict):
                if is_main_replica(item.replica_id):
                    (tensors if isinstance(item, ShardedTensor) else objects).append(item)
            planner = _StreamingSavePlanner(tensors, objects, make, dtype, on_tensor)
            writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, sync_files=True, thread_count=1)
            try:
                dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
            except CheckpointException as wrapped:  # one process: raise what it raised (OSError for a full disk)
                raise next(iter(wrapped.failures.values()))[0] from None

    return StreamingSaveStrategy(default.backend, default.version)


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the write items of Megatron ShardedTensors (stacked layer axes included) and objects;
    resolves each tensor item by calling `make` then, so no tensor exists before it is written."""

    def __init__(
        self, tensors: list, objects: list, make: Callable, dtype: torch.dtype, on_tensor: Callable[[int], None] | None
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.make, self.dtype, self.on_tensor = make, dtype, on_tensor
        self.tensors = {}
        for sh in tensors:
            if sh.flattened_range is not None:
                raise ValueError(f"{sh.key}: flattened (distributed optimizer) shards are not written by this strategy")
            chunk = ChunkStorageMetadata(
                offsets=torch.Size(sh.global_offset),
                sizes=torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape)),
            )
            self.tensors[MetadataIndex(sh.key, chunk.offsets)] = (sh, chunk)
        self.objects = {MetadataIndex(obj.unique_key): obj for obj in objects}

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties(dtype=self.dtype), size=torch.Size(sh.global_shape)
                ),
            )
            for index, (sh, chunk) in self.tensors.items()
        ]
        items += [WriteItem(index=index, type=WriteItemType.BYTE_IO) for index in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self.objects[write_item.index].data], buffer)
            return buffer
        sh, chunk = self.tensors[write_item.index]
        tensor = self.make(sh)
        if tuple(tensor.shape) != tuple(sh.local_shape):
            raise RuntimeError(
                f"{sh.key} at {tuple(sh.global_offset)}: made a tensor of shape {tuple(tensor.shape)}, "
                f"the checkpoint's shard is {tuple(sh.local_shape)}"
            )
        tensor = tensor.to(self.dtype).reshape(chunk.sizes)
        if self.on_tensor is not None:
            self.on_tensor(tensor.numel() * tensor.element_size())
        return tensor
