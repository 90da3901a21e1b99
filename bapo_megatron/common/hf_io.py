"""Hugging Face checkpoint directories: read safetensors shards (validated), write them atomically.

Only safetensors are read: a checkpoint is never unpickled. The family's disk layout
(models/on_disk.py) maps the names on disk to the text model's canonical ones here, once; the tensors
the family keeps untrained are checked and handed on by their names on disk (KeptSource); any other
tensor is refused by name. Every problem names the file or tensor at fault before any expensive work
is done with it; a shard outside the directory
(named so by the index, or a symbolic link leading out) is refused before any is opened. A
directory whose config.json or tokenizer_config.json would have transformers import code from it
(auto_map) is refused by name (refuse_remote_code_in); an export drops auto_map instead.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from bapo_megatron.common.safetensors_stream import SAFETENSORS_DTYPES, StreamingWriter, TensorEntry, plan_files
from bapo_megatron.errors import BadInputError, inside
from bapo_megatron.models import family_of
from bapo_megatron.models.on_disk import TEXT_LAYOUT, DiskLayout, KeptTensors
from bapo_megatron.models.quantized import (
    Quantization,
    QuantizedRelease,
    fp8_dequantize,
    fp8_scale_name,
    read_quantization,
)
from bapo_megatron.models.spec import REMOTE_CODE, ModelSpec, refuse_remote_code

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_SHARD_BYTES = 5 * 10**9
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 saves a tokenizer's chat template here
)


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")
"""The files of a model directory through which transformers would import code from it (auto_map)."""


def read_json_object(file: Path) -> dict:
    """A HF JSON file that must hold an object; BadInputError naming it otherwise."""
    try:
        value = json.loads(file.read_text())
    except ValueError as err:  # UnicodeDecodeError included
        raise BadInputError(f"{file}: not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise BadInputError(f"{file}: not a JSON object")
    return value


def refuse_remote_code_in(directory: str | Path) -> None:
    """BadInputError naming the file when a model directory's config.json or tokenizer_config.json
    asks transformers to import code from it: checked before transformers (or anything) reads it."""
    for name in REMOTE_CODE_FILES:
        if (Path(directory) / name).is_file():
            refuse_remote_code(read_json_object(Path(directory) / name), Path(directory) / name)


def without_remote_code(config: dict, source: str | Path) -> dict:
    """`config` as an export writes it: without auto_map, with a warning naming `source` when it had one
    (the export then loads with transformers' own classes, as the mapped models need)."""
    if REMOTE_CODE not in config:
        return config
    warnings.warn(f"{source}: its {REMOTE_CODE} is left out of the export (code that is never run)", stacklevel=2)
    return {k: v for k, v in config.items() if k != REMOTE_CODE}


FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
"""safetensors dtypes that hold weights; integer or boolean tensors would be cast silently."""
KEPT_FILE = "hf_kept.safetensors"
"""The tensors a Megatron checkpoint carries untouched for its HF export (Family.kept_tensors), beside
its hf_config.json."""


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of `spec` holds (canonical names: models/on_disk.py), with its
    shape, in loading order: embedding, layers in order (a MoE layer's experts one tensor each, as on
    disk), final norm, lm_head (absent when tied)."""
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    family = family_of(spec)
    for i in range(spec.num_layers):
        shapes.update(family.hf_layer_shapes(spec, i))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def hf_entries(spec: ModelSpec, dtype: torch.dtype, layout: DiskLayout = TEXT_LAYOUT) -> list[TensorEntry]:
    """The text model's tensors as a checkpoint in `layout` names them on disk, in `dtype`."""
    family = family_of(spec)
    return [
        TensorEntry(layout.disk_name(name), shape, torch.float32 if family.float32_tensor(name) else dtype)
        for name, shape in expected_shapes(spec).items()
    ]


class KeptSource:
    """Kept tensors (Family.kept_tensors) in open safetensors files, by their names on disk: their
    entries (own shapes and dtypes) and each tensor on demand, bitwise as stored."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self._handles = dict(sorted(handles.items()))

    def entries(self) -> list[TensorEntry]:
        out = []
        for name, handle in self._handles.items():
            tensor = handle.get_slice(name)
            out.append(TensorEntry(name, tuple(tensor.get_shape()), TORCH_DTYPES[tensor.get_dtype()]))
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[name].get_tensor(name)

    def __len__(self) -> int:
        return len(self._handles)

    def write(self, file: Path) -> None:
        """Every kept tensor into one safetensors file, one tensor in memory at a time."""
        writer = StreamingWriter(file.parent, [(file.name, self.entries())])
        for name in self._handles:
            writer.write(name, self[name])
        writer.close()

    def dequantized(self, quant: Quantization, source: Path) -> KeptSource:
        """The kept tensors as an unquantized export writes them: fp8 weights (of `quant`'s blocks)
        dequantized to bfloat16, their scales dropped; ValueError naming `source` and the tensor for
        a quantized one that cannot be (mxfp4, a weight without its scale)."""
        return _DequantizedKept(self._handles, quant, source)


class _DequantizedKept(KeptSource):
    def __init__(self, handles: dict[str, Any], quant: Quantization, source: Path) -> None:
        super().__init__(handles)
        self.quant, self._scales = quant, {}
        names = set(self._handles)
        for entry in super().entries():
            scale = fp8_scale_name(entry.name)
            if entry.dtype == torch.uint8 or (entry.dtype == torch.float8_e4m3fn and scale not in names):
                raise ValueError(
                    f"{source}: kept tensor {entry.name} is quantized; an unquantized export cannot write it"
                )
            if entry.dtype == torch.float8_e4m3fn:
                self._scales[entry.name] = scale

    def entries(self) -> list[TensorEntry]:
        scales = set(self._scales.values())
        return [
            TensorEntry(e.name, e.shape, torch.bfloat16) if e.name in self._scales else e
            for e in super().entries()
            if e.name not in scales
        ]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._scales:
            return super().__getitem__(name)
        weight, scale = super().__getitem__(name), super().__getitem__(self._scales[name])
        return fp8_dequantize(weight, scale, self.quant.block).bfloat16()


TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
"""safetensors dtypes a kept tensor may have (copied bitwise, never cast)."""


def _open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # safetensors reports truncation and bad headers with its own types
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def _check_kept(path: Path, handle: Any, name: str) -> None:
    """A kept tensor's header readable and its dtype one it is copied in bitwise."""
    dtype = handle.get_slice(name).get_dtype()
    if dtype not in TORCH_DTYPES:
        raise ValueError(
            f"{path}: kept tensor {name} is stored as {dtype}, which is not carried ({sorted(TORCH_DTYPES)})"
        )


def open_kept_file(path: Path, spec: ModelSpec, config: dict) -> KeptSource:
    """The kept tensors a Megatron checkpoint carries (KEPT_FILE), each one its family keeps for the
    model of `config` (its hf_config.json): ValueError naming the file and the tensor otherwise."""
    handle = _open(path)
    kept = family_of(spec).kept_tensors(spec, config)
    names = list(handle.keys())
    for name in names:
        if name not in kept:
            raise ValueError(f"{path}: {name} is no tensor the {spec.architecture} family keeps for this config")
        _check_kept(path, handle, name)
    _check_none_missing(kept, names, path, spec)
    return KeptSource(dict.fromkeys(names, handle))


def _check_none_missing(kept: KeptTensors, names: list[str], source: Path, spec: ModelSpec) -> None:
    """ValueError naming `source` and the first kept prefix (an MTP layer, the vision tower) none of
    `names` is under: a checkpoint carrying less than its config implies is refused where it is read,
    not found out by its export."""
    for prefix in kept.prefixes:
        if not any(name.startswith(prefix) for name in names):
            raise ValueError(
                f"{source}: holds no {prefix}* tensor, which the {spec.architecture} family keeps for this config"
            )


class HFCheckpoint:
    """A validated HF checkpoint directory: its spec, lazy access to its text model's tensors by their
    canonical names (whatever the family's disk layout: models/on_disk.py), and the tensors it keeps
    (`kept`, by their names on disk)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.spec = ModelSpec.from_hf_dir(self.dir)
        refuse_remote_code_in(self.dir)  # its tokenizer_config.json too: the engines and evaluate load it
        self.config = json.loads((self.dir / "config.json").read_text())
        family = family_of(self.spec)
        self.layout = family.disk_layout(self.config)
        on_disk, paths = self._shard_map()
        self._handles = {file: _open(paths[file]) for file in sorted(set(on_disk.values()))}
        kept = family.kept_tensors(self.spec, self.config)
        self._stored = {disk: file for disk, file in on_disk.items() if disk not in kept}
        self.release = self._release(paths)
        self.files: dict[str, str] = {}
        """Canonical name -> shard file, for the text model's tensors."""
        kept_handles, self._unaccounted = {}, []
        if self.release is not None:  # the quantized tensors by their unquantized names, the kept as stored
            on_disk = {**self._logical(), **{disk: file for disk, file in on_disk.items() if disk in kept}}
        for disk, file in on_disk.items():
            name = None if disk in kept else self.layout.canonical_name(disk)
            if disk in kept:
                _check_kept(paths[file], self._handles[file], disk)
                kept_handles[disk] = self._handles[file]
            elif name is None:
                self._unaccounted.append((disk, file))
            else:
                self.files[name] = file
        self.kept = KeptSource(kept_handles)
        self._check_shapes()
        _check_none_missing(kept, list(kept_handles), self.dir, self.spec)

    def _release(self, paths: dict[str, Path]) -> QuantizedRelease | None:
        """A quantized release's stored tensors (its kept ones aside, carried as stored), checked by
        name and file: every quantized weight with its scale (models/quantized.py)."""
        quant = read_quantization(self.config)
        if quant is None:
            return None
        headers = {}
        for disk, file in self._stored.items():
            tensor = self._handles[file].get_slice(disk)
            headers[disk] = (tensor.get_dtype(), tuple(tensor.get_shape()))
        return QuantizedRelease(quant, headers, lambda disk: paths[self._stored[disk]])

    def _logical(self) -> dict[str, str]:
        """A quantized release's tensors by their unquantized names on disk -> the file of their data."""
        return {name: self._stored[stored.parts[0]] for name, stored in self.release.tensors.items()}

    def _header(self, disk: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype) of the text model's tensor `disk` as read (dequantized)."""
        if self.release is not None:
            return self.release.tensors[disk].shape, self.release.dtypes[disk]
        tensor = self._handles[self._stored[disk]].get_slice(disk)
        return tuple(tensor.get_shape()), tensor.get_dtype()

    def _shard_map(self) -> tuple[dict[str, str], dict[str, Path]]:
        """Tensor name on disk -> shard file name, and each shard's path (inside the directory)."""
        index = self.dir / INDEX
        # the hub's cache keeps a snapshot's files as links to the blobs of its entry (snapshots/REV/../..)
        links_within = self.dir.parent.parent if self.dir.parent.name == "snapshots" else self.dir
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: no weight_map")
            paths = {}
            for file in weight_map.values():  # each checked before any is opened (a name may be no string)
                paths[file] = inside(self.dir, file, index, links_within)
            missing = sorted(f for f, path in paths.items() if not path.is_file())
            if missing:
                raise ValueError(f"{self.dir}: shard(s) named in {INDEX} are missing: {', '.join(missing)}")
            return dict(weight_map), paths
        if (self.dir / SINGLE).is_file():
            path = inside(self.dir, SINGLE, self.dir, links_within)
            with _open(path) as f:
                return dict.fromkeys(f.keys(), SINGLE), {SINGLE: path}
        raise ValueError(f"{self.dir}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")

    def _check_shapes(self) -> None:
        """Every tensor config.json implies is there with its shape, and every tensor in the files is
        one of them or one the family keeps: a config that disagrees with the weights (fewer layers, a
        tied head that is not) would otherwise convert part of the checkpoint and drop the rest silently."""
        expected, disk = expected_shapes(self.spec), self.layout.disk_name
        missing = [disk(n) for n in expected if n not in self.files]
        if missing:
            raise ValueError(f"{self.dir}: {len(missing)} tensors missing, e.g. {missing[0]}")
        for name, shape in expected.items():
            got, dtype = self._header(disk(name))
            if got != shape:
                raise ValueError(f"{self.dir}: {disk(name)} has shape {got}, config.json implies {shape}")
            if dtype not in FLOAT_DTYPES:
                raise ValueError(
                    f"{self.dir}: {disk(name)} is stored as {dtype}; weights must be floating point "
                    f"({', '.join(sorted(FLOAT_DTYPES))})"
                )
        # rotary inverse frequencies: a buffer older exports saved, recomputed from rope_theta
        unused = [(disk(n), f) for n, f in self.files.items() if n not in expected]
        unused = sorted(u for u in unused + self._unaccounted if not u[0].endswith("rotary_emb.inv_freq"))
        if self.spec.tie_embeddings and [u[0] for u in unused] == ["lm_head.weight"]:
            unused = []  # a tied head saved anyway (some exporters do): the embedding is the weight used
        if unused:
            (name, file), count = unused[0], len(unused)
            raise ValueError(
                f"{self.dir}: {count} tensors that config.json does not account for, e.g. {name} in {file} "
                "(is config.json this checkpoint's? num_hidden_layers, tie_word_embeddings; nor does the "
                f"{self.spec.architecture} family keep it)"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        """Tensor `name` (canonical) as stored, or dequantized (float32; mxfp4 in bfloat16, exact)
        from a quantized release: the caller casts it to the trainer's dtype."""
        disk = self.layout.disk_name(name)
        if self.release is not None:
            return self.release.read(disk, self._get_stored)
        return self._handles[self.files[name]].get_tensor(disk)

    def _get_stored(self, disk: str) -> torch.Tensor:
        return self._handles[self._stored[disk]].get_tensor(disk)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def keys(self):
        return self.files.keys()


def hf_writer(directory: Path, entries: list[TensorEntry], max_shard_bytes: int = MAX_SHARD_BYTES) -> StreamingWriter:
    """A StreamingWriter for the HF shard files of `entries` (model.safetensors or model-0000i-of-0000N)."""
    files = plan_files(
        entries, max_shard_bytes, lambda i, n: SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    )
    return StreamingWriter(directory, files)


def finish_hf_checkpoint(
    directory: Path, config: dict, template: Path | None, shards: StreamingWriter | None = None
) -> None:
    """config.json, the template's tokenizer files (tokenizer_config.json without auto_map) and, for HF
    shards written (and closed) by `shards` into several files, the index."""
    if shards is not None and len(set(shards.weight_map.values())) > 1:
        (directory / INDEX).write_text(
            json.dumps({"metadata": {"total_size": shards.total_bytes}, "weight_map": shards.weight_map}, indent=2)
        )
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if template is not None:
        for name in TOKENIZER_FILES:
            source = template / name
            if not source.is_file():
                continue
            if name == "tokenizer_config.json" and REMOTE_CODE in (settings := read_json_object(source)):
                (directory / name).write_text(json.dumps(without_remote_code(settings, source), indent=2))
            else:
                shutil.copy2(source, directory / name)
