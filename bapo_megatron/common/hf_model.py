"""A Hugging Face model directory as a transformers model, for every reader that runs one (the
embedded engine, `verify`'s reference, evaluation): safetensors only, no remote code, and a
quantized release (fp8 block scales, MXFP4 experts) built from its config without the quantization,
its weights read dequantized by the trainer's own reader.

transformers' loader cannot be trusted with every release the trainer reads: 5.24 refuses fp8
blocks that do not tile a tensor, and DeepSeek-V3's kv_a_proj_with_mqa (576 rows in 128x128
blocks) has a partial edge block. Reading the release through common/hf_io.HFCheckpoint (its
scales checked, edge blocks dequantized; models/quantized.py) makes every reader see exactly what
the trainer loads. The model is built by transformers from the config alone, every tensor of it
then filled from the release: one the release lacks, or one of the release's text model the model
has no place for, is refused in one line naming the directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from bapo_megatron.common.hf_experts import hf_target, per_expert
from bapo_megatron.common.hf_io import HFCheckpoint, KeptSource
from bapo_megatron.errors import BadInputError
from bapo_megatron.models.quantized import QUANTIZATION


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM in `model_dir` in `dtype`, in eval mode: a quantized release dequantized by the
    trainer's reader (load_release), any other by transformers (safetensors, no remote code)."""
    import transformers

    if is_quantized_release(model_dir):
        return load_release(model_dir, dtype).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, use_safetensors=True, trust_remote_code=False
    ).eval()


def is_quantized_release(model_dir: str | Path) -> bool:
    """Whether the model directory's config.json states a quantization (models/quantized.py)."""
    config = Path(model_dir) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get(QUANTIZATION))


def load_release(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The quantized release in `model_dir` as an unquantized transformers model in `dtype`, its weights
    dequantized as the trainer reads them; BadInputError naming the directory and the first tensor
    at fault (a scale missing or misshapen, a tensor the model lacks or the release does not hold)."""
    import transformers
    from transformers.initialization import no_init_weights

    release = HFCheckpoint(model_dir)  # checks every quantized tensor's scale before the model is built
    config = transformers.AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    if hasattr(config, QUANTIZATION):
        delattr(config, QUANTIZATION)  # the model holds dequantized weights: no quantized layers
    with no_init_weights():  # every weight is filled from the release: no random values drawn first
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)
    _fill(model, _release_tensors(release), Path(model_dir))
    return model


def _release_tensors(release: HFCheckpoint) -> Iterator[tuple[tuple[str, ...], torch.Tensor, bool]]:
    """(names the model may hold it under, tensor, whether the model must take it): the text model's
    tensors dequantized, by their names on disk or their text model's (a released multimodal layout,
    `model.language_model.*`, builds the text-only model), then the kept ones (a multi-token
    prediction layer, a vision tower), which a model without a place for them leaves out, as
    transformers' own loader does."""
    for name in release.files:
        yield (release.layout.disk_name(name), name), release[name], True
    kept: KeptSource = release.kept
    if release.release is not None and release.release.quant.method == "fp8" and len(kept):
        kept = kept.dequantized(release.release.quant, release.dir)
    for entry in kept.entries():
        yield (entry.name,), kept[entry.name], False


def _fill(model: torch.nn.Module, tensors: Iterator[tuple[tuple[str, ...], torch.Tensor, bool]], source: Path) -> None:
    """Copy every tensor into `model` (cast to its dtype); BadInputError naming `source` when the
    release holds a text-model tensor the model has no place for, or the model a tensor (tied ones
    are one) that the release did not fill."""
    state = model.state_dict(keep_vars=True)
    filled, unexpected = set(), []
    with torch.no_grad():
        for names, tensor, required in tensors:
            name, target = next(((n, t) for n in names if (t := hf_target(n, state)) is not None), (names[0], None))
            if target is None or tuple(target.shape) != tuple(tensor.shape):
                if required:
                    unexpected.append(name if target is None else f"{name} {tuple(tensor.shape)}")
                continue
            target.copy_(tensor)
            filled.add(_unit(target))
    missing = [name for name, tensor in per_expert(state) if _unit(tensor) not in filled]
    if missing or unexpected:
        said = []
        if missing:
            said.append(f"{len(missing)} tensors of the {type(model).__name__} are not in it, e.g. {missing[0]}")
        if unexpected:
            said.append(f"{len(unexpected)} of its tensors fit no tensor of the model, e.g. {unexpected[0]}")
        raise BadInputError(f"{source}: the release does not match the model its config.json builds: {'; '.join(said)}")


def _unit(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """What a tensor of the model is, as filled: its storage and shape (tied names share one; an
    expert's gate and up halves of a fused parameter are two)."""
    return tensor.data_ptr(), tuple(tensor.shape)
