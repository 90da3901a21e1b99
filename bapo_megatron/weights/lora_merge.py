"""A LoRA run's checkpoint of the adapters alone, merged onto its base for the Hugging Face export.

    merged = merged_onto_base(McoreCheckpoint(step), meta_model, given=None)   # convert.mcore_to_hf
    merged.hf_entries(torch.bfloat16); merged.hf_groups(on_disk=True)           # as McoreCheckpoint's

A LoRA run whose base has a source saves no copy of it (trainer/checkpoint.py): its step directory
names the base in lora_base.json (trainer/base_identity.py: path and fingerprint). The export reads
the base from there, or from a path given instead (a copy, a moved directory), a Hugging Face
directory or a dist checkpoint either way, and first checks that it is the base the adapters were
trained on: its fingerprint, taken as the trainer takes it (a model built on the meta device, each
window read from the base on disk), equal to the recorded one; another base is refused naming both.
The merge is PEFT's merge_and_unload in Hugging Face names: each adapted projection's weight plus
(alpha / r) B A in float32 (Megatron's fused q/k/v and gate/up never formed), streamed one base
tensor at a time, the adapters of one layer held.

Onto a quantized release (models/quantized.py) the merged model is written in the release's layout,
as the full export writes it: each weight the release quantizes quantized anew from its merged
float32 values (fp8 codes and fresh block scales, MXFP4 blocks), quantization_config kept, the kept
tensors as stored; or, from a checkpoint opened `dequantized`, plain weights, the kept ones
dequantized too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from bapo_megatron.common.hf_io import HFCheckpoint, KeptSource, expected_shapes, hf_entries
from bapo_megatron.common.safetensors_stream import TensorEntry
from bapo_megatron.config import ModelConfig, ParallelConfig
from bapo_megatron.models.lora import adapter_names
from bapo_megatron.models.lora_experts import hf_weight_names, per_projection
from bapo_megatron.models.quantized import Quantization
from bapo_megatron.trainer.base_identity import WINDOW, BaseIdentity, fingerprint, recorded_base
from bapo_megatron.trainer.checkpoint import weights_dir
from bapo_megatron.trainer.megatron_config import padded_vocab
from bapo_megatron.trainer.safe_load import read_metadata
from bapo_megatron.weights.layout import megatron_recipes, recipe_region
from bapo_megatron.weights.mcore_io import McoreCheckpoint
from bapo_megatron.weights.stored_chunks import StoredChunks

ROUNDINGS = (None, torch.bfloat16, torch.float16)
"""The trainer's precisions a base's values may have been rounded to before it took the fingerprint
(a float32 base trained in bf16): each is tried before a base is refused."""
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class BaseWeights:
    """The base a LoRA checkpoint names, opened: a Hugging Face directory or a dist checkpoint (a
    converted one, a run's step or checkpoint.dir), its tensors by canonical HF name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise ValueError(f"base {self.path}: no such directory")
        if (self.path / "config.json").is_file():
            self.hf, self.mcore = HFCheckpoint(self.path), None
            self.spec, self.layout, self.kept = self.hf.spec, self.hf.layout, self.hf.kept
        else:
            self.hf, self.mcore = None, McoreCheckpoint(weights_dir(self.path))
            if not self.mcore.holds_base or self.mcore.lora is not None:
                raise ValueError(f"base {self.path}: a LoRA run's checkpoint, not a base model")
            self.spec, self.layout, self.kept = self.mcore.spec, self.mcore.layout, self.mcore.kept

    @property
    def quantization(self) -> Quantization | None:
        """How the base is stored: a quantized release's quantization (its kept tensors are stored so)."""
        if self.hf is not None:
            return None if self.hf.release is None else self.hf.release.quant
        return self.mcore.quantization

    def text_groups(self) -> Iterator[dict[str, torch.Tensor]]:
        """The text model's tensors by canonical HF name, a group at a time."""
        if self.mcore is not None:
            yield from self.mcore.hf_groups(on_disk=False)
            return
        for name in expected_shapes(self.spec):
            yield {name: self.hf[name]}

    def window(self, model: torch.nn.Module):
        """The base_identity.Window reading each window of `model` (TP 1, built on the meta device)
        from this base: through the layout maps from a HF directory, as stored from a dist checkpoint."""
        if self.hf is not None:
            recipes = megatron_recipes(self.spec, padded_vocab(self.spec, ModelConfig(), ParallelConfig()))
            names = {id(p): n for n, p in model.state_dict(keep_vars=True).items()}

            def read(t, start: int) -> torch.Tensor:
                param = t.data if t.data._base is None else t.data._base  # a gated fc1's half
                inner, whole = _window_region(t, start)
                region = recipe_region(recipes[names[id(param)]], self.hf, *inner, whole, t.key)
                return region.reshape(-1).float()

            return read
        chunks = StoredChunks(self.mcore.dir, read_metadata(self.mcore.dir))

        def stored(t, start: int) -> torch.Tensor:
            if t.key not in self.mcore.meta:
                raise ValueError(f"base {self.path}: holds no {t.key}, which the model has (not this model's base)")
            (offsets, sizes), _ = _window_region(t, start)
            pre = t.prepend_axis_num
            lead = tuple(t.global_offset[:pre])
            region = chunks.read(t.key, (*lead, *offsets), ((1,) * pre + sizes), self.mcore.meta[t.key][1])
            return region.reshape(-1).float()

        return stored


def _window_region(t, start: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...]]:
    """((offsets, sizes) of the part of `t`'s window from `start`, in its whole TP 1 tensor; that shape)."""
    whole = tuple(t.global_shape[t.prepend_axis_num :])
    offsets = (*(0,) * (len(whole) - 1), start)
    sizes = (*(1,) * (len(whole) - 1), min(WINDOW, whole[-1]) - start)
    return (offsets, sizes), whole


def check_base_weights(base: BaseWeights, record: BaseIdentity, model: torch.nn.Module, source: Path) -> None:
    """ValueError naming both when `base` is not the base `record` (the checkpoint `source`'s) names:
    its fingerprint, read through `model` (TP 1, meta device) in float32 and each of ROUNDINGS, differs."""
    read = base.window(model)
    cache: dict[tuple, torch.Tensor] = {}

    def once(t, start: int) -> torch.Tensor:
        key = (t.key, tuple(t.global_offset), start)
        if key not in cache:
            cache[key] = read(t, start)
        return cache[key]

    found = []
    for rounding in ROUNDINGS:
        rounded = once if rounding is None else (lambda t, s, r=rounding: once(t, s).to(r).float())
        digest, _ = fingerprint([model], base.spec.vocab_size, rounded)
        if digest == record.fingerprint:
            return
        found.append(digest)
    raise ValueError(
        f"base {base.path} has other weights (fingerprint {found[0][:12]}) than the base {record.where} that "
        f"the adapters of {source} were trained on (fingerprint {record.fingerprint[:12]}, its lora_base.json): "
        "pass --base with that base"
    )


def open_base(source: McoreCheckpoint, given: str | Path | None) -> tuple[BaseWeights, BaseIdentity | None]:
    """The base of an adapter-only checkpoint: `given`, else the path its lora_base.json records
    (ValueError when it records none or that path is gone); with the record, to check it against."""
    record = recorded_base(source.dir)
    if given is None and (record is None or record.path is None):
        raise ValueError(
            f"{source.dir} holds LoRA adapters alone and records no base path to merge them onto: pass --base PATH"
        )
    path = Path(given) if given is not None else Path(record.path)
    if given is None and not path.exists():
        raise ValueError(
            f"{source.dir}: the base its adapters were trained on, {path} (its lora_base.json), is not there: "
            "pass --base PATH (a copy of it)"
        )
    base = BaseWeights(path)
    if base.spec != source.spec:
        raise ValueError(f"base {path} is another model than the one {source.dir} holds adapters of")
    return base, record


class MergedModel:
    """A LoRA checkpoint's adapters merged onto its base, read as McoreCheckpoint's export reads."""

    def __init__(self, source: McoreCheckpoint, base: BaseWeights) -> None:
        self.source, self.base, self.spec = source, base, source.spec
        self.scaling = source.lora.alpha / source.lora.rank
        self.names = adapter_names(source.spec, source.lora)  # Megatron -> PEFT
        self.quantization = source.quantization  # None: unquantized, or opened `dequantized`
        self.kept = base.kept
        if self.quantization is None and base.quantization is not None:
            self.kept = base.kept.dequantized(base.quantization, base.path)

    def hf_entries(self, dtype: torch.dtype) -> list[TensorEntry]:
        text = hf_entries(self.spec, dtype, self.base.layout)
        if self.quantization is not None:
            text = [TensorEntry(*e) for e in self.quantization.entries([(e.name, e.shape, e.dtype) for e in text])]
        return text + self.kept.entries()

    def hf_groups(self, on_disk: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """As McoreCheckpoint.hf_groups: the text model's groups (adapted weights merged), then on disk
        under the layout's names (quantized as the release stores them) with the kept tensors;
        ValueError if an adapter found no weight."""
        merged, layer, pairs = set(), None, {}
        for group in self.base.text_groups():
            out = {}
            for name, tensor in group.items():
                at = _LAYER.match(name)
                if at is not None and int(at[1]) != layer:
                    layer, pairs = int(at[1]), self._pairs(int(at[1]))
                if name in pairs:
                    tensor = self._merge(name, tensor, *pairs[name])
                    merged.add(name)
                if on_disk:
                    out.update(self._stored(self.base.layout.disk_name(name), tensor))
                else:
                    out[name] = tensor
            yield out
        wanted = {w for peft in self.names.values() for w in hf_weight_names(self.spec, _weight_of(peft))}
        if wanted - merged:
            missing = sorted(wanted - merged)[0]
            raise ValueError(f"base {self.base.path} has no weight {missing} to merge an adapter into")
        if on_disk:
            yield from _kept_groups(self.kept)

    def _stored(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tensor `name` (on disk) as the export stores it: quantized where the release quantizes it."""
        return {name: tensor} if self.quantization is None else self.quantization.quantize(name, tensor)

    def _pairs(self, layer: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Layer `layer`'s adapters: HF weight name -> (A, B), whole."""
        found: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.source.adapters(layer).items():
            peft = self.names[name]
            found.setdefault(_weight_of(peft), {})["A" if ".lora_A." in peft else "B"] = tensor
        pairs = {weight: (m["A"], m["B"]) for weight, m in found.items()}
        return per_projection(self.spec, pairs)  # experts' per weight

    def _merge(self, name: str, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        delta = self.scaling * (b.float() @ a.float())
        if delta.shape != weight.shape:
            raise ValueError(
                f"{self.source.dir}: the adapter of {name} is {tuple(delta.shape)}, the base's weight "
                f"{tuple(weight.shape)}"
            )
        return weight.float() + delta


def _weight_of(peft: str) -> str:
    """The HF weight a PEFT adapter name adapts (base_model.model.X.lora_A.weight -> X.weight)."""
    return peft.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] + ".weight"


def _kept_groups(kept: KeptSource) -> Iterator[dict[str, torch.Tensor]]:
    for entry in kept.entries():
        yield {entry.name: kept[entry.name]}


def merged_onto_base(source: McoreCheckpoint, model, given: str | Path | None = None) -> MergedModel:
    """`source` (adapters alone) merged onto its base (open_base), checked to be the recorded base
    through `model` (a callable building the TP 1 LoRA model on the meta device) where it records one."""
    base, record = open_base(source, given)
    if record is not None:
        check_base_weights(base, record, model(), source.dir)
    return MergedModel(source, base)
