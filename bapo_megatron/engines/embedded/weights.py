"""The embedded engine's weights: the model as loaded from its directory, the checks and loads of
weight updates, and the release and resumption of the weights' memory.

The model runs in the dtype asked for (float32, or bfloat16 as a GPU engine would); weights sent in
another dtype are cast as they are loaded. Names are HF's: a mixture-of-experts model's weights may
come one tensor per expert, the checkpoints' names, into transformers' fused expert parameters
(common/hf_experts.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from bapo_megatron.common.hf_experts import expert_slot, hf_target, per_expert
from bapo_megatron.common.hf_model import load_causal_lm


def load_model(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The served model, built from its HF directory (common/hf_model.py: safetensors only; a quantized
    release dequantized by the trainer's own reader), in eval mode."""
    return load_causal_lm(model_dir, dtype)


def eos_ids(model) -> set[int]:
    """The token ids that end a request unless it ignores them: the model's and its generation config's."""
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return ids


class ServedWeights:
    """The served model's parameters as weight updates see them: checked, loaded, released, resumed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.released = False  # the parameters' storage is freed (release_memory_occupation of weights)
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}  # id(parameter) -> its shape, while released
        self._unloaded: set[tuple] = set()  # tensors resumed without values, not loaded since (_load_unit)

    @property
    def unloaded(self) -> int:
        """How many weight tensors were resumed without values and have not been loaded since."""
        return len(self._unloaded)

    def check(self, announced: Iterable[tuple[str, torch.dtype, Sequence[int]]]) -> None:
        """ValueError naming the first (name, dtype, shape) that cannot be loaded into the served model:
        a name it has no parameter of, a dtype not floating point, another shape. Names are HF's:
        a MoE layer's experts one tensor each (`mlp.experts.E.gate_proj.weight`), checked against
        their slot in the fused parameter. What an update announces is checked with this before
        anything of it is allocated."""
        if self.released:
            raise ValueError("the weights are released: resume_memory_occupation(weights) before loading them")
        state = self.model.state_dict(keep_vars=True)
        for name, dtype, shape in announced:
            target = hf_target(name, state)
            if target is None:
                raise ValueError(f"{name}: the model has no such parameter")
            if not dtype.is_floating_point:
                raise ValueError(f"{name}: dtype {dtype}; weights must be floating point")
            if tuple(shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(shape)}, the model's is {tuple(target.shape)}")

    def load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the model (cast to its dtype); all are checked before any is copied."""
        pending = list(tensors)
        self.check((name, tensor.dtype, tensor.shape) for name, tensor in pending)
        state = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in pending:
                hf_target(name, state).copy_(tensor)
                self._unloaded.discard(_load_unit(name, state))
        return len(pending)

    def release(self) -> None:
        """Free every parameter's storage; their values are lost, as SGLang's are under its memory saver."""
        for param in self.model.parameters():  # tied weights are one parameter
            self._shapes[id(param)] = (param.shape, param.dtype)
            param.data = torch.empty(0, dtype=param.dtype)
        self.released = True

    def resume(self) -> None:
        """Take the parameters' memory back, holding no values until every tensor is loaded again."""
        for param in self.model.parameters():
            shape, dtype = self._shapes.pop(id(param))
            param.data = torch.empty(shape, dtype=dtype)
        state = self.model.state_dict(keep_vars=True)
        self._unloaded = {_load_unit(name, state) for name, _ in per_expert(state)}
        self.released = False


def _load_unit(name: str, state: dict[str, torch.Tensor]) -> tuple:
    """What HF tensor `name` fills in `state`, as a key: its parameter (tied names share one) and,
    for a per-expert name, the expert and the rows of the fused parameter."""
    slot = expert_slot(name, state)
    if slot is None:
        return (id(state[name]),)
    return (id(state[slot.param]), slot.expert, None if slot.rows is None else slot.rows.start)
