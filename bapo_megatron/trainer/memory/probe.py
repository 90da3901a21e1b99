"""Measure a training step's memory on the CPU, term by term, to hold the estimate (estimate.py) to.

    with LiveBytes() as probe:      # counts what ops allocate inside the block
        trainer.train_step(batch)
    probe.peak                      # the most of those bytes alive at once

    measure_step(trainer, batch)    # MeasuredMemory: parameters, gradients, optimizer, activations

CPU torch keeps no allocator statistics, so LiveBytes watches allocations itself: a torch dispatch
mode sees every op's outputs and counts the storage of each that is new (an op whose schema
returns an alias of an input, a view, an in-place or out= op, made none), once, and takes its bytes
off when the storage is freed (a weakref finalizer: torch keeps one Python object per storage
while it lives). The autograd engine runs a CPU backward on the calling thread with the caller's
dispatch modes on, so backward's allocations are counted too (tests/dist/test_memory_measured.py).
Not seen: what a kernel allocates and frees inside itself, and storages made outside the
dispatcher. The peak is that of the tensors Python and autograd hold, as a GPU's caching allocator
would hold them, less its rounding and fragmentation.
"""

from __future__ import annotations

import gc
import random
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bapo_megatron.common.batch import RolloutBatch, Sample


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops created inside the block and that are still alive, and the
    most of them alive at once (`peak`, which reset_peak() brings down to what is alive now)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # data_ptr of each live storage counted -> its bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view, an in-place or out= op: its storage is its input's
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in self._sizes:
            return
        self._sizes[ptr] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, ptr)

    def _freed(self, ptr: int) -> None:
        self.live -= self._sizes.pop(ptr)

    def reset_peak(self) -> None:
        self.peak = self.live

    def bytes_of(self, data_ptr: int) -> int:
        """The bytes of the live storage at data_ptr, if it was counted here (else 0)."""
        return self._sizes.get(data_ptr, 0)


def _storages(tensors) -> dict[int, int]:
    """data_ptr -> bytes of the distinct storages of `tensors`."""
    found = {}
    for t in tensors:
        storage = t.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors a Megatron optimizer (chained or not) steps and keeps: each torch optimizer's
    state (Adam's moments) and the parameters it updates (the model's own, or fp32 main copies)."""
    held = []
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            held += [v for v in state.values() if isinstance(v, torch.Tensor)]
        held += [p for group in inner.optimizer.param_groups for p in group["params"]]
    return held


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes one trainer rank holds, measured: the terms of estimate.MemoryEstimate."""

    params: int
    grads: int
    """DDP's gradient buffers."""
    optimizer: int
    """What the optimizer keeps beyond the model: Adam's moments, fp32 main parameters."""
    activations: int
    """The most bytes alive at once during a step beyond the three above: what forward keeps for
    backward, the temporaries of both, and what the step keeps from one step to the next (Megatron's
    global memory buffer, which the local attention's scores are computed into)."""

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations


def measure_step(trainer, batch) -> MeasuredMemory:
    """Two optimizer steps of `trainer` (a PolicyTrainer) on `batch`, measured at the second: the
    optimizer's state exists then, as in every step but the first."""
    from megatron.core import parallel_state

    # The buffer is process-wide and only grows: emptied, the steps below allocate what they need,
    # as in a fresh process, whatever an earlier model in this one took
    parallel_state.get_global_memory_buffer().buffer.clear()
    model = _storages(p for chunk in trainer.model for p in chunk.parameters())
    grads = _storages(b.grad_data for chunk in trainer.model for b in chunk.buffers + chunk.expert_parallel_buffers)
    gc.collect()
    with LiveBytes() as probe:
        trainer.train_step(batch)
        gc.collect()
        probe.reset_peak()
        trainer.train_step(batch)
    kept = {ptr: n for ptr, n in _storages(optimizer_tensors(trainer.optimizer)).items() if ptr not in model}
    made_here = sum(probe.bytes_of(ptr) for ptr in kept)  # the state its first step made
    return MeasuredMemory(
        params=sum(model.values()),
        grads=sum(grads.values()),
        optimizer=sum(kept.values()),
        activations=probe.peak - made_here,
    )


def fixed_batch(vocab: int, seq: int, samples: int = 2):
    """`samples` samples of exactly `seq` tokens (a quarter prompt), one group."""
    rng = random.Random(0)
    out = []
    for i in range(samples):
        prompt = [rng.randrange(vocab) for _ in range(seq // 4)]
        n = seq - len(prompt)
        response = [rng.randrange(vocab) for _ in range(n)]
        out.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                behaviour_logprobs=[-5.0] * n,
                versions=[0] * n,
                reward=float(i),
                group=0,
            )
        )
    return RolloutBatch(samples=out)
