"""The study's lower-precision engine: the embedded engine's weights fake-quantised to a few values.

The natural gap between the bf16 embedded engine and the fp32 trainer is too small for a rollout
correction to act on (README.md: no token weight outside [0.5, 2]). This study widens it the way a
weight-only quantised inference engine (GPTQ, AWQ, int4 serving) does: every linear weight the
engine holds is rounded to one of the 2 * levels + 1 values {-levels, ..., levels} x s, with one
scale s per output row (its absmax / levels; int4 is levels 7, int3 levels 3), while the trainer keeps
its exact fp32 weights. As those engines do, embeddings, the output head,
norms and a mixture-of-experts model's router stay as they are (the routes still move, through the
quantised layers before them). Deterministic: the same weights give the same engine.

The product has no such option: it exists for the study only. `install(levels)` wraps the engine
core so that the weights it loads at start and every weight update after it are quantised on the
way in; `sitecustomize.py` beside this file calls it in the engine's own process when
$ROLLOUT_CORR_STUDY_ENGINE_LEVELS is set (run.py puts this folder on PYTHONPATH, which the engine
subprocess inherits). Checksums of weight updates (rollout.sync.verify) are checked on the tensors
as received, before this runs.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

import torch

ENV = "ROLLOUT_CORR_STUDY_ENGINE_LEVELS"
"""The engine's levels a sign (a whole number in [1, 127]); unset: the engine is left as it is."""
CORE = "bapo_megatron.engines.embedded.core"
KEPT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "router")
"""HF name parts of the tensors left unquantised, as weight-only quantised engines leave them."""


def quantised(name: str) -> bool:
    """Whether the engine's tensor `name` (HF naming, experts one tensor each) is quantised."""
    return name.endswith(".weight") and not any(part in name for part in KEPT)


def fake_quantise(weight: torch.Tensor, levels: int) -> torch.Tensor:
    """`weight` rounded to integers in [-levels, levels] times one scale per row (over its last
    dimension: a linear layer's output row), returned in its dtype; a row of zeros stays zeros."""
    if not 1 <= levels <= 127:
        raise ValueError(f"{ENV}: levels must lie in [1, 127], not {levels}")
    if weight.dim() < 2:
        raise ValueError(f"fake_quantise: a weight of 2 or more dimensions, not shape {tuple(weight.shape)}")
    w = weight.float()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / levels
    return (torch.round(w / scale).clamp(-levels, levels) * scale).to(weight.dtype)


def quantise_named(tensors, levels: int):
    """(name, tensor) pairs with the quantised ones replaced (a new tensor; the input is untouched)."""
    for name, tensor in tensors:
        yield name, fake_quantise(tensor, levels) if quantised(name) and tensor.dim() >= 2 else tensor


def patch_core(module, levels: int | None) -> None:
    """Quantise every weight the engine core loads from now on (its model as built, every update
    after) to `levels` levels; None: load them as they are again."""
    from bapo_megatron.common.hf_experts import per_expert

    core = module.EngineCore
    if not hasattr(core, "study_levels"):
        init, load = core.__init__, core.load_weights

        def load_weights(self, tensors):
            levels = type(self).study_levels
            return load(self, tensors if levels is None else quantise_named(tensors, levels))

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if type(self).study_levels is not None:
                state = self.model.state_dict()
                self.load_weights([(name, t.clone()) for name, t in per_expert(state) if quantised(name)])

        core.__init__, core.load_weights = __init__, load_weights
    core.study_levels = levels


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the engine core right after its module runs, in whichever process imports it."""

    def __init__(self, levels: int) -> None:
        self.levels = levels

    def find_spec(self, fullname, path, target=None):
        if fullname != CORE:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch_core(module, self.levels)

        spec.loader.exec_module = exec_module
        return spec


def install(levels: int | None = None) -> int | None:
    """Quantise the engine core's weights in this process from now on (levels: $ENV's when None;
    nothing when that is unset). Returns the levels installed."""
    if levels is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return None
        try:
            levels = int(text)
        except ValueError:
            raise ValueError(f"${ENV}: {text!r} is not a whole number of levels") from None
    fake_quantise(torch.zeros(1, 1), levels)  # refuses bad levels here, not inside the engine
    if CORE in sys.modules:
        patch_core(sys.modules[CORE], levels)
    else:
        sys.meta_path.insert(0, _PatchOnImport(levels))
    return levels
