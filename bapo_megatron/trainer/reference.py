"""The reference policy of the KL loss (algo.kl_coef > 0): the run's starting weights, frozen.

A second set of the policy's Megatron model chunks, built by the same code at the same layout, with
no gradient, optimizer or DDP wrapper: each rank holds its parameters' bytes once more (the dry
run counts them: trainer/memory/estimate.py). The trainer fills it once, from the policy's weights after
they are loaded (a converted checkpoint, a Hugging Face model, or the seed's random weights). A
checkpoint stores it beside the policy under REFERENCE_PREFIX and a resume loads it from there, so
a resumed run measures its KL to the weights it started from, never to the weights it resumed
(reloading model.hf_path instead would need that directory unchanged, and a randomly
initialised run has none). Its log-probs come from one forward-only pass of the pipeline schedule
a step (PolicyTrainer._reference_pass).

Under LoRA (model.lora) none of this is built: the base is frozen and the adapters start at zero
(B = 0), so the base with the adapters off (trainer/lora.adapters_off) is the starting policy at
every step, as NeMo-RL and verl take it. The reference pass runs the policy's own chunks inside
adapters_off: no second copy of the weights, nothing more in the checkpoint (which holds the adapters
alone, the base loaded from its source at every start: trainer/checkpoint.py), and the memory estimate
counts no reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bapo_megatron.trainer.dist_ckpt import load_module_state, unwrap

REFERENCE_PREFIX = "reference."
"""The reference's tensors in a checkpoint: the policy's global names under this prefix (no clash
with the policy's own, which loaders of model weights read)."""


class ReferenceModel:
    """Frozen model chunks of one trainer rank, one per (virtual) pipeline stage like the policy's."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        for chunk in chunks:
            chunk.requires_grad_(False)
        self.chunks = chunks
        self.ready = False
        """Whether the chunks hold weights (they are built without initialising them)."""

    def copy_from(self, model_chunks: list[torch.nn.Module]) -> None:
        """The policy's current weights, as the reference (called once they are the starting weights)."""
        with torch.no_grad():
            for reference, chunk in zip(self.chunks, model_chunks, strict=True):
                reference.load_state_dict(unwrap(chunk).state_dict())
        self.ready = True

    def sharded_state_dict(self, is_loading: bool = False) -> dict:
        """The chunks' sharded tensors for a checkpoint, under REFERENCE_PREFIX."""
        assert self.ready or is_loading, "the reference model is saved before it holds the starting weights"
        return {f"chunk{i}": chunk.sharded_state_dict(prefix=REFERENCE_PREFIX) for i, chunk in enumerate(self.chunks)}

    def load(self, loaded: dict, source: str | Path) -> None:
        """The tensors sharded_state_dict() asked a checkpoint for, into the chunks."""
        for i, chunk in enumerate(self.chunks):
            state = {key.removeprefix(REFERENCE_PREFIX): value for key, value in loaded[f"chunk{i}"].items()}
            load_module_state(chunk, state, source)
        self.ready = True
