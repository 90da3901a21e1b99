"""Run Megatron-Core 0.16.1 on CPU (tests, the CPU demo): the one place that patches upstream.

    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    activate_cpu_shim()   # before building models; a no-op when it is already active

Megatron-Core assumes CUDA in a few places on the paths we use: `device="cuda"` tensors in
the pipeline schedules, `torch.cuda.current_device()` and `torch.cuda.synchronize()` in
p2p communication, rotary embeddings, the DDP buffers and the global memory buffer, and
the CUDA RNG tracker's get/set state. The shim sends every CUDA placement to the CPU (a
torch function mode), makes the stream and synchronisation calls no-ops, and backs the
RNG tracker with the CPU generator. It is pinned to one megatron-core version: the canary
test (tests/unit/test_cpu_shim.py) fails when the version or the patched call sites change.
"""

from __future__ import annotations

import contextlib
import importlib.metadata

import torch
from torch.overrides import TorchFunctionMode

SUPPORTED_MEGATRON_CORE = "0.16.1"

PATCHED_CALL_SITES: dict[str, tuple[str, ...]] = {
    # module -> names the shim depends on; the canary checks they still exist there.
    "megatron.core.tensor_parallel.random": ("_get_cuda_rng_state", "_set_cuda_rng_state"),
    "megatron.core.pipeline_parallel.p2p_communication": ("torch",),
    "megatron.core.models.common.embeddings.rotary_pos_embedding": ("torch",),
    "megatron.core.optimizer.optimizer": ("clip_grad_by_total_norm_fp32",),
}

_state: dict[str, object] = {}


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch reads a bare int device as a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Every CUDA placement (device= arguments, .cuda(), .to('cuda')) becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for a CUDA stream: waits and records are no-ops on CPU."""

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event


def _cpu_rng_get(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(new_state: torch.Tensor, device=-1, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    """Megatron's clip_grad_by_total_norm_fp32 (same coefficient, same in-place scaling) minus
    its assertion that gradients are CUDA tensors."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr) for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_([g.detach() for g in grads], clip_coeff)


def megatron_core_version() -> str:
    return importlib.metadata.version("megatron-core")


def activate_cpu_shim() -> None:
    """Patch torch.cuda's CPU-hostile calls and megatron's RNG tracker for this process."""
    if _state:
        return
    version = megatron_core_version()
    if version != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"the CPU shim is written for megatron-core {SUPPORTED_MEGATRON_CORE}, found {version}: "
            "re-check the patched call sites (bapo_megatron/trainer/cpu_shim.py) before using it"
        )
    if torch.cuda.is_available():
        raise RuntimeError("activate_cpu_shim() is for machines without CUDA; this one has it")
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import random as mrandom

    patches = [
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "default_stream", lambda device=None: _NullStream()),
        (torch.cuda, "current_stream", lambda device=None: _NullStream()),
        (torch.cuda, "stream", lambda stream=None: contextlib.nullcontext()),
        (torch.cuda, "empty_cache", lambda: None),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "set_rng_state", lambda state, device="cuda": torch.set_rng_state(state)),
        (torch.cuda, "manual_seed", torch.manual_seed),
        (mrandom, "_get_cuda_rng_state", _cpu_rng_get),
        (mrandom, "_set_cuda_rng_state", _cpu_rng_set),
        (moptimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_cpu),
    ]
    _state["originals"] = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    mode = _CudaToCpu()
    mode.__enter__()
    _state["mode"] = mode


def deactivate_cpu_shim() -> None:
    """Undo activate_cpu_shim (tests)."""
    if not _state:
        return
    _state["mode"].__exit__(None, None, None)
    for owner, name, original in _state["originals"]:
        setattr(owner, name, original)
    _state.clear()


def cpu_shim_active() -> bool:
    return bool(_state)
