"""Megatron dist checkpoints without a model: read one decoder layer (one expert) at a time as HF
tensors, and written one tensor at a time from tensors made on demand.

dist_checkpointing stores a dense model's decoder parameters stacked over layers under one
global key (e.g. `decoder.layers.self_attention.linear_qkv.weight`, shape [layers, ...]); a
mixture-of-experts model's layers differ, so each layer has keys of its own
(`decoder.layers.3.mlp.router.weight`), and a layer's experts are one tensor over the global
experts (`decoder.layers.3.mlp.experts.experts.linear_fc1.weight`, shape [experts, ...]) whatever
the expert-parallel size that saved it. Norms are stored under Transformer Engine's names
whatever layer spec saved them, a MoE layer's pre-MLP norm included. Asking for one layer's (one
expert's) slice reads just that slice, so a conversion holds one layer's dense part, or one
expert, at a time. Works on checkpoints written by the converter and by the trainer (their model
keys are the same; optimizer keys are ignored), saved at any TP/PP/EP. The model's shape is the
checkpoint's: a config (the carried hf_config.json, or a template) is checked against the tensors
(layers, hidden size, a separate output layer, the embedding's rows) and against what the checkpoint
records of its model (hf_config.json, run.json), since top-k and the vocabulary inside its padding
show in no tensor; a disagreement is refused naming the field and both values. The tensors its
family keeps untrained (hf_kept.safetensors beside hf_config.json) are checked to be ones it keeps and
come back bitwise, after the text model, under their names on disk.

Writing goes through dist_checkpointing.save with StreamingSaveStrategy: the sharded state
dict is a model's, built on the meta device (so the keys, shards and objects are exactly
Megatron's), and each tensor is made when the writer reaches it.
"""

from __future__ import annotations

import io
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from bapo_megatron.common.hf_io import (
    KEPT_FILE,
    KeptSource,
    hf_entries,
    open_kept_file,
    read_json_object,
    without_remote_code,
)
from bapo_megatron.common.safetensors_stream import TensorEntry
from bapo_megatron.errors import BadInputError, inside
from bapo_megatron.models import family_of
from bapo_megatron.models.lora import is_adapter, merge_adapters
from bapo_megatron.models.lora_experts import stored_per_expert
from bapo_megatron.models.quantized import QUANTIZATION, read_quantization
from bapo_megatron.models.recipes import STORED_EXPERTS, expert_names
from bapo_megatron.models.spec import REMOTE_CODE, ModelSpec, first_difference, spec_fields
from bapo_megatron.trainer.checkpoint import HF_CONFIG, RUN_RECORD, run_record
from bapo_megatron.trainer.dist_ckpt import saved_lora
from bapo_megatron.trainer.integrity import verify_integrity
from bapo_megatron.weights.layout import megatron_layer_to_hf
from bapo_megatron.weights.stored_chunks import StoredChunks

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"
STORED_IMPL = "transformer_engine"  # the norm names every layer spec saves under


_STORED_MLP_NORM = "mlp.linear_fc1.layer_norm_weight"  # a MoE layer's pre_mlp_layernorm is stored under it too


def layer_shapes(spec: ModelSpec, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s stored Megatron suffixes and their whole (TP=1) shapes, experts' with their
    leading [experts] axis (the layers of a dense model are all alike)."""
    return family_of(spec).stored_layer_shapes(spec, layer)


def read_hf_config(directory: Path, template: Path | None = None) -> tuple[dict, Path]:
    """The HF config.json of a Megatron checkpoint's model, as an export writes it (auto_map left out),
    and the file it came from: the template's when one is given (an override, checked against the
    checkpoint's tensors and records), else the checkpoint's hf_config.json (the converter's and the
    trainer's step directories carry one)."""
    if template is not None:
        source = template / "config.json"
    elif (directory / HF_CONFIG).exists() or (directory / HF_CONFIG).is_symlink():
        source = inside(directory, HF_CONFIG, directory)  # a link out of the checkpoint is refused
    else:
        raise ValueError(f"{directory}: no {HF_CONFIG}; pass --hf-template DIR with the model's config.json")
    if not source.is_file():
        raise ValueError(f"{source}: no such file")
    return without_remote_code(read_json_object(source), source), source


def recorded_models(directory: Path) -> list[tuple[Path, dict[str, object]]]:
    """What a checkpoint itself says its model is, as spec_fields: its hf_config.json (when it carries
    one) and its run.json's model.* entries (a trainer's step directory); the fields tensors cannot
    show (top-k, the vocabulary inside its padding, head sizes) come only from these."""
    found = []
    if (directory / HF_CONFIG).exists() or (directory / HF_CONFIG).is_symlink():
        source = inside(directory, HF_CONFIG, directory)
        config = {k: v for k, v in read_json_object(source).items() if k != REMOTE_CODE}  # compared, not run
        try:
            found.append((source, spec_fields(ModelSpec.from_hf_config(config, source))))
        except ValueError as err:  # a template cannot stand in for it: it is what the template is checked against
            raise BadInputError(
                f"{err} (the checkpoint's own record of its model, which --hf-template is checked against: "
                f"a checkpoint whose record is unreadable is not converted)"
            ) from None
    run = run_record(directory)
    if run is not None and isinstance(run.get("config"), dict):
        model = {k.removeprefix("model."): v for k, v in run["config"].items() if k.startswith("model.")}
        found.append((directory / RUN_RECORD, model))
    return found


@dataclass(frozen=True)
class Read:
    """One tensor to read from a dist checkpoint: stored tensor `key` at the leading indices `lead`
    (a layer of stacked layers, then an expert; those axes dropped), or all of it."""

    key: str
    lead: tuple[int, ...] = ()


class McoreCheckpoint:
    """A validated Megatron dist checkpoint directory of a mapped model; HF tensors on demand.

    Reads the storage under Megatron's torch_dist format (torch DCP) through StoredChunks:
    memory-mapped, one slice at a time, no process group needed. Everything a conversion will
    read is checked against the model's config before anything is read: each tensor there, its
    shape (a MoE layer's expert count), and its stored chunks covering every slice asked for. A
    quantized release's model (hf_config.json's quantization_config) is exported quantized as it came
    (models/quantized.py); `dequantized`: in the export's dtype, without its quantization_config.
    """

    def __init__(self, directory: str | Path, template: str | Path | None = None, dequantized: bool = False) -> None:
        self.dir = Path(directory)
        if not (self.dir / "metadata.json").is_file():
            raise ValueError(
                f"{self.dir}: not a complete Megatron dist checkpoint (no metadata.json), nor a run's "
                "checkpoint.dir (no complete step_NNNNNNNN in it)"
            )
        self.config, self.source = read_hf_config(self.dir, Path(template) if template else None)
        self.spec = ModelSpec.from_hf_config(self.config, self.source)
        self.layout = family_of(self.spec).disk_layout(self.config)
        # a quantized release's export is quantized as it was (models/quantized.py), or `dequantized`
        self.quantization = released = read_quantization(self.config)
        if dequantized:
            self.quantization, self.config = None, {k: v for k, v in self.config.items() if k != QUANTIZATION}
        self._check_records()
        # files present, whole, and as written; .metadata read without running code
        metadata = verify_integrity(self.dir)
        self.meta = {
            k: (tuple(m.size), m.properties.dtype)
            for k, m in metadata.state_dict_metadata.items()
            if hasattr(m, "size")
        }
        self._chunks = StoredChunks(self.dir, metadata)
        self.lora = saved_lora(self.dir)  # a LoRA run's: its adapters are merged into the export
        self.holds_base = EMBEDDING in self.meta  # False: a LoRA run's adapters alone (weights/lora_merge.py)
        if self.holds_base:
            self._check_model_shape()
            self._check()
        self.kept = self._kept()
        if dequantized and released is not None:
            self.kept = self.kept.dequantized(released, self.dir / KEPT_FILE)

    def _kept(self) -> KeptSource:
        """The tensors the checkpoint carries for its HF export (checksummed with it, each one its family
        keeps), none when it carries none: a warning then when its family would keep some (a checkpoint
        started from a model without them, or converted before checkpoints carried them)."""
        if not ((self.dir / KEPT_FILE).exists() or (self.dir / KEPT_FILE).is_symlink()):
            if family_of(self.spec).kept_tensors(self.spec, self.config):
                warnings.warn(
                    f"{self.dir}: carries no {KEPT_FILE}; the export holds the trained model only, not the "
                    f"tensors {self.source.name} implies beside it (multi-token prediction, vision)",
                    stacklevel=3,
                )
            return KeptSource({})
        return open_kept_file(inside(self.dir, KEPT_FILE, self.dir), self.spec, self.config)

    def _check_records(self) -> None:
        """The config in use (a template's, or the carried one) describes the model the checkpoint
        records: every field, top-k and the vocabulary size included, as its hf_config.json and its
        run.json state them; an export routing top-3 on a top-2 model, or cutting the vocabulary, is
        refused naming the field."""
        ours = spec_fields(self.spec)
        for file, theirs in recorded_models(self.dir):
            found = first_difference(ours, theirs)
            if found is not None and file != self.source:
                field, mine, recorded = found
                raise ValueError(
                    f"{self.source}: {field}={mine!r}, but the checkpoint's {file.name} says {recorded!r} ({file})"
                )

    def _check_model_shape(self) -> None:
        """The config's shape against what the tensors show, by field: hidden size, layer count, a
        separate output layer, a vocabulary that fits the embedding's (padded) rows."""
        spec, rows = self.spec, self.meta.get(EMBEDDING, ((0,),))[0][0]
        shown = [("num_hidden_layers", spec.num_layers, self._stored_layers())]
        if FINAL_NORM in self.meta:
            shown.append(("hidden_size", spec.hidden_size, self.meta[FINAL_NORM][0][0]))
        shown.append(("tie_word_embeddings", spec.tie_embeddings, OUTPUT not in self.meta))
        for field, mine, stored in shown:
            if mine != stored:
                raise ValueError(
                    f"{self.source}: {field}={mine!r}, but the checkpoint's tensors say {stored!r} ({self.dir})"
                )
        if spec.vocab_size > rows:
            raise ValueError(
                f"{self.source}: vocab_size={spec.vocab_size}, but the checkpoint's embedding holds {rows} rows "
                f"({self.dir})"
            )

    def _stored_layers(self) -> int:
        """The decoder layers the tensors hold: a stacked key's leading axis, or the layers' own keys."""
        count = 0
        for key, (shape, _) in self.meta.items():
            if key.startswith("decoder.layers."):
                head = key.split(".")[2]
                count = max(count, int(head) + 1 if head.isdigit() else shape[0])
        return count

    def _stored(self, layer: int, suffix: str) -> Read:
        """Where layer `layer`'s `suffix` is: a key of its own (MoE models) or a slice of the stacked key
        (dense models); where Megatron would have put it when it is in neither."""
        own, stacked = f"decoder.layers.{layer}.{suffix}", f"decoder.layers.{suffix}"
        if own in self.meta or (stacked not in self.meta and self.spec.moe is not None):
            return Read(own)
        return Read(stacked, (layer,))

    def _layer_reads(self, layer: int) -> dict[str, Read]:
        """Layer `layer`'s tensors under the names megatron_layer_to_hf reads (Transformer Engine's
        layer spec, experts one after another by global index)."""
        m, mlp_norm = f"decoder.layers.{layer}.", family_of(self.spec).norm_names(self.spec, layer, STORED_IMPL)[1]
        reads = {}
        for suffix in layer_shapes(self.spec, layer):
            stored = self._stored(layer, suffix)
            if suffix in STORED_EXPERTS:
                fc = STORED_EXPERTS.index(suffix)
                for e in range(self.spec.moe.num_experts):
                    reads[m + expert_names(e, grouped=False)[fc]] = Read(stored.key, (*stored.lead, e))
            elif suffix == _STORED_MLP_NORM:
                reads[m + mlp_norm] = stored
            else:
                reads[m + suffix] = stored
        return reads

    def _check(self) -> None:
        """Everything a conversion reads, before anything is read: each tensor there with the shape the
        config implies (experts counted first), every slice read stored whole, every chunk readable."""
        expected = self._expected_shapes()
        self._check_expert_count(expected)
        for key, shape in expected.items():
            if key not in self.meta:
                raise ValueError(f"{self.dir}: no tensor {key} (is hf_config.json the config of this model?)")
            self._check_shape(key, self.meta[key][0], shape)
        for name, read in self._reads().items():
            if not self._chunks.covers(read.key, *self._region(read)):
                raise ValueError(
                    f"{self.dir}: {name} is incomplete: the stored chunks of {read.key} do not cover it "
                    "(a corrupt checkpoint)"
                )
        for key in expected:
            self._chunks.check(key, self.meta[key][1])

    def _expected_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """Every stored key a conversion reads, with its global shape (None: padded vocabulary rows)."""
        spec = self.spec
        expected: dict[str, tuple[int, ...] | None] = {EMBEDDING: None, FINAL_NORM: (spec.hidden_size,)}
        if not spec.tie_embeddings:
            expected[OUTPUT] = None
        for i in range(spec.num_layers):
            for suffix, shape in layer_shapes(spec, i).items():
                stored = self._stored(i, suffix)
                expected[stored.key] = (spec.num_layers, *shape) if stored.lead else shape
        return expected

    def _check_expert_count(self, expected: dict[str, tuple[int, ...] | None]) -> None:
        """Before any other shape: a stored expert count other than the config's says so by name."""
        for key in expected:
            got = self.meta[key][0] if key in self.meta else ()
            if key.endswith(STORED_EXPERTS) and len(got) >= 3 and got[-3] != self.spec.moe.num_experts:
                raise ValueError(
                    f"{self.dir}: {key} holds {got[-3]} experts, the model's config says "
                    f"num_experts={self.spec.moe.num_experts} (is hf_config.json the config of this model?)"
                )

    def _check_shape(self, key: str, got: tuple[int, ...], shape: tuple[int, ...] | None) -> None:
        spec = self.spec
        if shape is None:  # vocabulary rows, padded
            if len(got) != 2 or got[1] != spec.hidden_size or got[0] < spec.vocab_size:
                raise ValueError(
                    f"{self.dir}: {key} has shape {got}, expected (>= {spec.vocab_size}, {spec.hidden_size})"
                )
        elif got != shape:
            raise ValueError(f"{self.dir}: {key} has shape {got}, the model's config implies {shape}")

    def _reads(self) -> dict[str, Read]:
        """Every tensor a conversion reads, by its Megatron name."""
        heads = (EMBEDDING, FINAL_NORM) if self.spec.tie_embeddings else (EMBEDDING, FINAL_NORM, OUTPUT)
        reads = {key: Read(key) for key in heads}
        for i in range(self.spec.num_layers):
            reads.update(self._layer_reads(i))
        return reads

    def _region(self, read: Read) -> tuple[tuple[int, ...], tuple[int, ...]]:
        shape, n = self.meta[read.key][0], len(read.lead)
        return (*read.lead, *(0,) * (len(shape) - n)), (*(1,) * n, *shape[n:])

    def _load(self, read: Read) -> torch.Tensor:
        offsets, sizes = self._region(read)
        tensor = self._chunks.read(read.key, offsets, sizes, self.meta[read.key][1])
        return tensor.reshape(sizes[len(read.lead) :])

    def adapters(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s LoRA adapters, whole, by Megatron's name (models/lora.py megatron_name)."""
        out = {}
        for key in (k for k in self.meta if k.startswith("decoder.layers.") and is_adapter(k)):
            head, _, tail = key.removeprefix("decoder.layers.").partition(".")
            suffix = tail if head.isdigit() else f"{head}.{tail}"  # a layer's own key, or the stacked one
            if (read := self._stored(layer, suffix)).key in self.meta:
                out |= stored_per_expert(f"decoder.layers.{layer}.", suffix, self._load(read))
        return out

    def _with_adapters(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer `layer`'s tensors as _layer_reads names them, and its LoRA adapters."""
        return {**{name: self._load(read) for name, read in self._layer_reads(layer).items()}, **self.adapters(layer)}

    def hf_groups(self, on_disk: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """HF (name -> tensor) groups in loading order: the embedding; each layer (a MoE layer's dense
        part, then its experts one at a time); the final norm and untied lm_head. Vocabulary padding
        trimmed. One group is in memory at a time. on_disk: named as the checkpoint the model came
        from names them on disk (its family's layout), then the kept tensors, one a group, bitwise."""
        if not on_disk:
            yield from self._text_groups()
            return
        quantize = self.quantization.quantize if self.quantization is not None else lambda n, t: {n: t}
        for group in self._text_groups():
            yield {k: v for n, t in group.items() for k, v in quantize(self.layout.disk_name(n), t).items()}
        for entry in self.kept.entries():
            yield {entry.name: self.kept[entry.name]}

    def hf_entries(self, dtype: torch.dtype) -> list[TensorEntry]:
        """What hf_groups(on_disk=True) yields, the text model's tensors in `dtype`, the kept in their own."""
        text = hf_entries(self.spec, dtype, self.layout)
        if self.quantization is not None:
            text = [TensorEntry(*e) for e in self.quantization.entries([(e.name, e.shape, e.dtype) for e in text])]
        return text + self.kept.entries()

    def _text_groups(self) -> Iterator[dict[str, torch.Tensor]]:
        vocab = self.spec.vocab_size
        yield {"model.embed_tokens.weight": self._load(Read(EMBEDDING))[:vocab]}
        for i in range(self.spec.num_layers):
            stored = _LazyTensors(self._layer_reads(i), self._load)
            if self.lora is not None:  # merged: the whole layer is read at once (a MoE layer: its experts too)
                stored = merge_adapters(self.spec, self._with_adapters(i), self.lora.alpha / self.lora.rank)
            pairs = megatron_layer_to_hf(self.spec, i, stored, STORED_IMPL)
            for _, group in groupby(pairs, key=lambda pair: _expert_of(pair[0])):
                yield dict(group)
        final = {"model.norm.weight": self._load(Read(FINAL_NORM))}
        if not self.spec.tie_embeddings:
            final["lm_head.weight"] = self._load(Read(OUTPUT))[:vocab]
        yield final


_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def _expert_of(hf_name: str) -> int | None:
    match = _EXPERT.search(hf_name)
    return int(match[1]) if match else None


class _LazyTensors(Mapping):
    """name -> tensor, each read when asked for (so a layer's experts are read one at a time)."""

    def __init__(self, reads: dict[str, Read], load: Callable[[Read], torch.Tensor]) -> None:
        self.reads, self.load = reads, load

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.load(self.reads[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.reads)

    def __len__(self) -> int:
        return len(self.reads)


def streaming_save_strategy(
    make: Callable, dtype: torch.dtype, on_tensor: Callable[[int], None] | None = None, *, spec: ModelSpec
):
    """A dist_checkpointing sharded save strategy writing Megatron's torch_dist format through torch
    DCP, one tensor at a time: `make(sharded_tensor)` returns each ShardedTensor's data (its
    `data` may be a placeholder, e.g. on the meta device) when the writer reaches it, cast to
    `dtype` (but the tensors `spec`'s family keeps in float32, Family.float32_tensor);
    `on_tensor(nbytes)` after each. Peak memory: one tensor, not the model. One
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
            planner = _StreamingSavePlanner(tensors, objects, make, dtype, on_tensor, family_of(spec).float32_tensor)
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
        self,
        tensors: list,
        objects: list,
        make: Callable,
        dtype: torch.dtype,
        on_tensor: Callable[[int], None] | None,
        float32: Callable[[str], bool],
    ) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.make, self.dtype, self.on_tensor, self.float32 = make, dtype, on_tensor, float32
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

    def _dtype(self, sh) -> torch.dtype:
        """The dtype tensor `sh` is written in: the checkpoint's, or float32 where Megatron keeps it so."""
        return torch.float32 if self.float32(sh.key) else self.dtype

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk, properties=TensorProperties(dtype=self._dtype(sh)), size=torch.Size(sh.global_shape)
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
        tensor = tensor.to(self._dtype(sh)).reshape(chunk.sizes)
        if self.on_tensor is not None:
            self.on_tensor(tensor.numel() * tensor.element_size())
        return tensor
