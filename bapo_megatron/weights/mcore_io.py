"""A Megatron dist checkpoint read one decoder layer at a time, as HF tensors.

dist_checkpointing stores each decoder parameter stacked over layers under one global key
(e.g. `decoder.layers.self_attention.linear_qkv.weight`, shape [layers, ...]) and with
Transformer Engine's names for the two norms, whatever layer spec saved it. Asking it for
one layer's slice reads just that slice, so a conversion holds one layer at a time. Works
on checkpoints written by the converter and by the trainer (their model keys are the same;
optimizer keys are ignored), saved at any TP/PP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from bapo_megatron.trainer.model_spec import ModelSpec
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

    Reads through torch.distributed.checkpoint (the storage under Megatron's torch_dist
    format) with a planner that asks for exactly the slices wanted; no process group needed.
    """

    def __init__(self, directory: str | Path, template: str | Path | None = None) -> None:
        self.dir = Path(directory)
        if not (self.dir / "metadata.json").is_file():
            raise ValueError(f"{self.dir}: not a complete Megatron dist checkpoint (no metadata.json)")
        self.config = read_hf_config(self.dir, Path(template) if template else None)
        self.spec = ModelSpec.from_hf_config(self.config)
        self._reader = FileSystemReader(str(self.dir))
        try:
            self.meta = {k: (tuple(m.size), m.properties.dtype)
                         for k, m in self._reader.read_metadata().state_dict_metadata.items() if hasattr(m, "size")}
        except Exception as err:  # torch DCP raises several types for a damaged .metadata
            raise ValueError(f"{self.dir}: unreadable checkpoint metadata ({err})") from None
        self._check()

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
                    raise ValueError(f"{self.dir}: {key} has shape {got}, expected "
                                     f"(>= {spec.vocab_size}, {spec.hidden_size})")
            elif got != shape:
                raise ValueError(f"{self.dir}: {key} has shape {got}, the model's config implies {shape}")

    def _load(self, requests: dict[str, tuple[str, int | None]]) -> dict[str, torch.Tensor]:
        """{name: (stored key, layer or None)} -> {name: tensor}; a layer index reads one slice."""
        dest, offsets, names = {}, {}, {}
        for name, (key, layer) in requests.items():
            shape, dtype = self.meta[key]
            if layer is None:
                dest[key], offsets[key] = torch.empty(shape, dtype=dtype), (0,) * len(shape)
            else:
                dest[key] = torch.empty((1, *shape[1:]), dtype=dtype)
                offsets[key] = (layer,) + (0,) * (len(shape) - 1)
            names[key] = (name, layer is not None)
        dcp.load(dest, storage_reader=self._reader, planner=SlicePlanner(offsets), no_dist=True)
        return {names[k][0]: (t[0] if names[k][1] else t) for k, t in dest.items()}

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



class SlicePlanner(DefaultLoadPlanner):
    """Reads, for each key, the slice of the stored tensor at `offsets[key]` the size of the
    destination tensor (however the stored chunks are split: any saving TP/PP)."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets = offsets

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, tensor in self.state_dict.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[key]), sizes=tensor.size())
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index) -> torch.Tensor:
        return self.state_dict[index.fqn]
