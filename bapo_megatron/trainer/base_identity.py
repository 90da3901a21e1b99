"""Which base model a LoRA run's adapters were trained on, recorded in its checkpoints and checked on resume.

    identify_base(trainer, "model.hf_path", "/models/Qwen2.5-32B", resume_from)   # every rank, before a step

Adapters only make sense on the base they were trained on: resumed on another one, training would go
on from adapters that no longer fit, and engines that start from model.hf_path and receive adapters
alone would serve another model than the trainer's. So each checkpoint of a LoRA run carries
BASE_FILE: the path the base was loaded from and a fingerprint of its weights, and a resume, once the
new run's base is loaded (before the checkpoint's state and before any step), compares them: another
base (another fingerprint, from another path or the same path whose weights changed) is refused with
one error line naming both; the same weights by another path (a copy, a moved directory) are accepted
with a note.

What the fingerprint covers (COVERS): every base tensor of the Megatron model by its checkpoint key and
whole (TP = 1) shape, the vocabulary's padding left out, and the float32 values of the first WINDOW
elements of each layer's (and each expert's) copy of it (index 0 of every other axis: a weight's first
row), gathered on rank 0 from whichever ranks hold them. It is the same at any TP / PP / EP / DP layout
and in any training precision that holds the base exactly (bf16 weights in a bf16 or fp32 trainer), and
it costs one small gather (a 32B dense model: about 0.6 MB). It is an identity, not a checksum: weights
changed only outside those rows go unnoticed (trainer/integrity.py checks a checkpoint's bytes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bapo_megatron.errors import BadInputError, ConfigError
from bapo_megatron.models.lora import is_adapter
from bapo_megatron.trainer.dist_ckpt import is_rank0, unwrap

BASE_FILE = "lora_base.json"
"""A LoRA run's step directory's record of its base (BaseIdentity as JSON)."""
WINDOW = 256
"""Elements of each base tensor's first row that the fingerprint reads."""
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
"""Keys whose first axis is the vocabulary, padded by the layout (TP): counted unpadded."""
COVERS = (
    f"sha256 over every base tensor's checkpoint key and whole shape (vocabulary unpadded) and the float32 "
    f"values of the first {WINDOW} elements of each layer's and expert's copy (index 0 of every other axis)"
)


@dataclass(frozen=True)
class BaseIdentity:
    """The base a LoRA run trains adapters on."""

    path: str | None
    """Where it was loaded from (model.mcore_path's or model.hf_path's directory, absolute); None: the
    seed's random initialisation (no starting weights)."""
    fingerprint: str
    """COVERS, hex."""
    tensors: int
    """How many base tensors the fingerprint names."""
    covers: str = COVERS

    @property
    def where(self) -> str:
        return self.path if self.path is not None else "the seed's random initialisation"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"


Window = Callable[[object, int], torch.Tensor]
"""(a base ShardedTensor, the offset of its part in the window) -> the float32 values of that part of
its window, read from elsewhere than the tensor (whose data may be on the meta device)."""


def fingerprint(model_chunks: list[torch.nn.Module], vocab_size: int, window: Window | None = None) -> tuple[str, int]:
    """(COVERS of the chunks' base weights, how many tensors: a layer's or an expert's each), the
    same on every rank: gathered on rank 0 and its digest broadcast, when a group is initialised.
    `window`: where each window's values come from (a base on disk, for a model built on the meta
    device: weights/lora_merge.py), instead of the chunks' own tensors."""
    mine = _local_parts(model_chunks, vocab_size, window)
    everyone, result = [mine], [None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size() if is_rank0() else None
        dist.gather_object(mine, everyone, dst=0)
    if is_rank0():
        result = [_digest(everyone)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    return result[0]


def _digest(everyone: list[tuple[dict, list]]) -> tuple[str, int]:
    shapes: dict[str, list[int]] = {}
    rows: dict[tuple[str, tuple[int, ...]], dict[int, torch.Tensor]] = {}
    for their_shapes, their_pieces in everyone:
        shapes.update(their_shapes)
        for key, index, start, values in their_pieces:
            rows.setdefault((key, index), {})[start] = values
    digest = hashlib.sha256()
    for key in sorted(shapes):
        digest.update(json.dumps([key, shapes[key]]).encode())
        for index in sorted(i for k, i in rows if k == key):
            parts = rows[key, index]
            row = torch.cat([parts[s] for s in sorted(parts)])
            assert row.numel() == min(WINDOW, shapes[key][-1]), f"{key}{list(index)}: window not whole"
            digest.update(json.dumps(index).encode() + row.numpy().tobytes())
    return digest.hexdigest(), len(rows)


def _local_parts(model_chunks: list[torch.nn.Module], vocab_size: int, window: Window | None) -> tuple[dict, list]:
    """This rank's part: {key: whole shape} of the base tensors it holds the main copy of, and
    (key, index on the stacking axes, offset, float32 values) of the part of each window it holds.
    Megatron stacks a tensor of every layer (and expert) under one key, on prepended axes: each
    layer's (expert's) own has a window."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica

    shapes, pieces = {}, []
    for chunk in model_chunks:
        sharded = unwrap(chunk).sharded_state_dict()
        apply_factories(sharded)  # a gated fc1's two halves, as its checkpoint holds them
        for t in nested_values(sharded):
            if not isinstance(t, ShardedTensor) or is_adapter(t.key) or not is_main_replica(t.replica_id):
                continue
            shape = list(t.global_shape)
            if t.key in VOCAB_KEYS:
                shape[0] = vocab_size
            shapes[t.key] = shape
            piece = _window_part(t, window)
            if piece is not None:
                pieces.append((t.key, *piece))
    return shapes, pieces


def _window_part(t, window: Window | None) -> tuple[tuple[int, ...], int, torch.Tensor] | None:
    """(index on the stacking axes, offset in the window, values) of the part of its tensor's window
    [0, ..., 0, :WINDOW] that this shard holds; None: none of it."""
    pre, offsets = t.prepend_axis_num, t.global_offset
    inner = offsets[pre:]
    if t.data.dim() == 0 or t.flattened_range is not None or any(o != 0 for o in inner[:-1]):
        return None
    first = inner[-1]
    if first >= WINDOW:
        return None
    if window is not None:
        return tuple(offsets[:pre]), first, window(t, first)
    row = t.data[(0,) * (t.data.dim() - 1)]
    return tuple(offsets[:pre]), first, row[: WINDOW - first].detach().float().cpu().clone()


def identify_base(trainer, field: str, path: str | Path | None, resume_from: Path | None = None) -> BaseIdentity:
    """The base now in `trainer` (loaded from `path`, the config's `field`: model.hf_path,
    model.mcore_path, or seed for a random initialisation), recorded for its checkpoints (rank 0's
    model_files); with `resume_from`, checked against the base that checkpoint's run trained on:
    ConfigError on every rank for another one, a note on rank 0 for the same weights by another path.
    Every rank calls it, after the base is loaded and before the checkpoint's state or a step."""
    digest, count = fingerprint(trainer.model, trainer.spec.vocab_size)
    mine = BaseIdentity(str(Path(path).resolve()) if path is not None else None, digest, count)
    if is_rank0():
        trainer.model_files[BASE_FILE] = mine.to_json()
    if resume_from is not None:
        note = check_base(resume_from, mine, field)
        if note and is_rank0():
            print(note, flush=True)
    return mine


def recorded_base(directory: str | Path) -> BaseIdentity | None:
    """The base a LoRA run's step directory records (None: saved before checkpoints recorded it);
    BadInputError for a record that is not one."""
    path = Path(directory) / BASE_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text()) if path.stat().st_size < 1 << 16 else None
        return BaseIdentity(**record)
    except (ValueError, TypeError):
        raise BadInputError(f"checkpoint {directory}: {BASE_FILE} is not the base record a LoRA run writes") from None


def check_base(directory: str | Path, mine: BaseIdentity, field: str = "model.hf_path") -> str | None:
    """None when the checkpoint at `directory` was trained on the base `mine` names, at the same path;
    a note for the same weights by another path or a checkpoint that records none; ConfigError on
    `field` (where this run's base comes from) naming both otherwise."""
    theirs = recorded_base(directory)
    if theirs is None:
        return f"checkpoint {directory} does not record the base its adapters were trained on: not checked"
    if theirs.fingerprint == mine.fingerprint:
        if theirs.path == mine.path:
            return None
        return (
            f"checkpoint {directory}: its adapters were trained on {theirs.where}; this run's base {mine.where} "
            f"has the same weights (fingerprint {mine.fingerprint[:12]}): resuming on it"
        )
    raise ConfigError(
        field,
        mine.where,
        f"checkpoint {directory} holds LoRA adapters trained on the base {theirs.where} (fingerprint "
        f"{theirs.fingerprint[:12]}), and this run's base {mine.where} has other weights (fingerprint "
        f"{mine.fingerprint[:12]}): resume on the base they were trained on, or start a new run",
    )
