"""Hugging Face checkpoint directories: read safetensors shards (validated), write them atomically.

Only safetensors are read: a checkpoint is never unpickled. Every problem names the file
or tensor at fault before any expensive work is done with it; a shard outside the directory
(named so by the index, or a symbolic link leading out) is refused before any is opened. A
directory whose config.json or tokenizer_config.json would have transformers import code from it
(auto_map) is refused by name (refuse_remote_code_in); an export drops auto_map instead.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch

from bapo_megatron.common.safetensors_stream import StreamingWriter, TensorEntry, plan_files
from bapo_megatron.errors import BadInputError, inside
from bapo_megatron.models import family_of
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


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor a HF checkpoint of `spec` holds, with its shape, in loading order: embedding,
    layers in order (a MoE layer's experts one tensor each, as on disk), final norm, lm_head (absent
    when tied)."""
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size)}
    family = family_of(spec)
    for i in range(spec.num_layers):
        shapes.update(family.hf_layer_shapes(spec, i))
    shapes["model.norm.weight"] = (spec.hidden_size,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def hf_entries(spec: ModelSpec, dtype: torch.dtype) -> list[TensorEntry]:
    return [TensorEntry(name, shape, dtype) for name, shape in expected_shapes(spec).items()]


class HFCheckpoint:
    """A validated HF checkpoint directory: its spec, and lazy access to its tensors."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.dir = Path(directory)
        self.spec = ModelSpec.from_hf_dir(self.dir)
        refuse_remote_code_in(self.dir)  # its tokenizer_config.json too: the engines and evaluate load it
        self.config = json.loads((self.dir / "config.json").read_text())
        self.files, paths = self._shard_map()
        self._handles = {}
        for file in sorted(set(self.files.values())):
            try:
                self._handles[file] = safe_open(str(paths[file]), framework="pt")
            except Exception as err:  # safetensors reports truncation and bad headers with its own types
                raise ValueError(f"{paths[file]}: not a readable safetensors file ({err})") from None
        self._check_shapes()

    def _shard_map(self) -> tuple[dict[str, str], dict[str, Path]]:
        """Tensor name -> shard file name, and each shard's path (inside the directory)."""
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
            from safetensors import safe_open

            path = inside(self.dir, SINGLE, self.dir, links_within)
            try:
                with safe_open(str(path), framework="pt") as f:
                    return dict.fromkeys(f.keys(), SINGLE), {SINGLE: path}
            except Exception as err:
                raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
        raise ValueError(f"{self.dir}: no {SINGLE} or {INDEX} (only safetensors checkpoints are read)")

    def _check_shapes(self) -> None:
        """Every tensor config.json implies is there with its shape, and every tensor in the files is
        one of them: a config that disagrees with the weights (fewer layers, a tied head that is
        not) would otherwise convert part of the checkpoint and drop the rest silently."""
        expected = expected_shapes(self.spec)
        missing = [n for n in expected if n not in self.files]
        if missing:
            raise ValueError(f"{self.dir}: {len(missing)} tensors missing, e.g. {missing[0]}")
        for name, shape in expected.items():
            tensor = self._handles[self.files[name]].get_slice(name)
            got = tuple(tensor.get_shape())
            if got != shape:
                raise ValueError(f"{self.dir}: {name} has shape {got}, config.json implies {shape}")
            if tensor.get_dtype() not in FLOAT_DTYPES:
                raise ValueError(
                    f"{self.dir}: {name} is stored as {tensor.get_dtype()}; weights must be floating point "
                    f"({', '.join(sorted(FLOAT_DTYPES))})"
                )
        # rotary inverse frequencies: a buffer older exports saved, recomputed from rope_theta
        unused = sorted(n for n in set(self.files) - set(expected) if not n.endswith("rotary_emb.inv_freq"))
        if self.spec.tie_embeddings and unused == ["lm_head.weight"]:
            unused = []  # a tied head saved anyway (some exporters do): the embedding is the weight used
        if unused:
            raise ValueError(
                f"{self.dir}: {len(unused)} tensors that config.json does not account for, e.g. {unused[0]} "
                "(is config.json this checkpoint's? num_hidden_layers, tie_word_embeddings)"
            )

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._handles[self.files[name]].get_tensor(name)

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
