"""Run Megatron-Core 0.16.1 on CPU (tests, the CPU demo): the one place that patches upstream.

    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    activate_cpu_shim()   # before building models; a no-op when it is already active

Megatron-Core assumes CUDA in a few places on the paths we use: `device="cuda"` tensors in
the pipeline schedules, `torch.cuda.current_device()` and `torch.cuda.synchronize()` in
p2p communication, rotary embeddings, the DDP buffers and the global memory buffer, and
the CUDA RNG tracker's get/set state. The shim sends every CUDA placement to the CPU (a
torch function mode), makes the stream and synchronisation calls no-ops, and backs the
RNG tracker with the CPU generator. Mixture-of-experts layers and sequence parallel add four
more: the router's gating GEMM names Transformer Engine's `te_general_gemm`, left undefined when
TE is absent (moe_utils.py); the alltoall dispatcher makes a `torch.cuda.Stream` and records an
event on it (token_dispatcher.py); its split sizes stay tensors on CPU, which gloo's
`all_to_all_single` refuses (it takes lists); sequence parallel's norm is refused without apex
(torch_norm.py): the shim builds torch's norm and marks its weight `sequence_parallel`, as apex's
and TE's norms do, so that Megatron sums its gradient over the tensor-parallel ranks. A fifth
is torch's: a torch function mode is off inside its own handler, and `Tensor.backward` and
`torch.autograd.backward` are torch functions, so a backward started by either runs without the
mode; full recompute starts one inside every recomputed layer's backward (CheckpointFunction
calls torch.autograd.backward), whose all-to-all backward then places its buffer on CUDA. The
shim puts the mode back around each custom autograd Function's backward (BackwardCFunction.apply,
which the engine calls).
It is pinned to one megatron-core version: the canary test (tests/unit/test_cpu_shim.py) fails
when the version or the patched call sites change.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import sys

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

SUPPORTED_MEGATRON_CORE = "0.16.1"

PATCHED_CALL_SITES: dict[str, tuple[str, ...]] = {
    # module -> names the shim depends on; the canary checks they still exist there.
    "megatron.core.jit": ("jit_fuser", "enable_jit_fuser", "disable_jit_fuser"),
    "megatron.core.tensor_parallel.random": ("_get_cuda_rng_state", "_set_cuda_rng_state", "CheckpointFunction"),
    "megatron.core.pipeline_parallel.p2p_communication": ("torch",),
    "megatron.core.models.common.embeddings.rotary_pos_embedding": ("torch",),
    "megatron.core.optimizer.optimizer": ("clip_grad_by_total_norm_fp32",),
    "megatron.core.transformer.moe.moe_utils": ("RouterGatingLinearFunction", "maybe_move_tensor_to_cpu"),
    "megatron.core.transformer.moe.token_dispatcher": ("MoEAlltoAllTokenDispatcher",),
    "megatron.core.tensor_parallel.mappings": ("_AllToAll",),
    "megatron.core.transformer.torch_norm": ("WrappedTorchNorm",),
    "torch.autograd.function": ("BackwardCFunction",),  # the functional canary pins its use
}

_state: dict[str, object] = {}
_MISSING = object()


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch reads a bare int device as a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Every CUDA placement (device= arguments, .cuda(), .to('cuda')) becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # runs on every torch call of a step (thousands): no copy of kwargs unless one changes
        if not kwargs:
            kwargs = {}
        elif _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NullEvent:
    """Stands in for a CUDA event."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def record(self, stream=None) -> None:
        pass


class _NullStream:
    """Stands in for a CUDA stream: waits and records are no-ops on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()


def _split_list(sizes):
    return sizes if sizes is None or isinstance(sizes, list) else [int(n) for n in sizes]


def _all_to_all_single_with_list_splits(original):
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        return original(output, input, _split_list(output_split_sizes), _split_list(input_split_sizes), **kwargs)

    return all_to_all_single


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


def _norm_allowing_sequence_parallel(original):
    """WrappedTorchNorm.__new__ that builds under sequence parallel too: the norm is per token, so a
    rank's slice of the sequence needs nothing but its weight's gradient summed over the TP ranks."""

    def __new__(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original(cls, plain, hidden_size, eps, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return __new__


def _backward_in_mode(original, mode: TorchFunctionMode):
    """BackwardCFunction.apply that runs a custom backward with the mode on, entering it only where a
    torch function handler (of `Tensor.backward`, `torch.autograd.backward`) left it off."""

    def apply(self, *args):
        if any(m is mode for m in _get_current_function_mode_stack()):
            return original(self, *args)
        with mode:
            return original(self, *args)

    return apply


def megatron_core_version() -> str:
    return importlib.metadata.version("megatron-core")


def _eager(model=None, **options):
    """torch.compile's signature, compiling nothing: `@jit_fuser` returns the function itself."""
    return model if model is not None else (lambda fn: fn)


def import_megatron_eager() -> None:
    """Megatron-Core as Megatron's own disable_jit_fuser() leaves it: megatron/core/jit.py sets
    jit_fuser = torch.compile at import, and the fusions it decorates while megatron.core imports
    pull in torch._dynamo and torch._inductor: 1.4 s and about 70 MB of PSS in every CPU process
    that imports Megatron, for fusions the local spec calls eagerly or not at all (a compile on CPU
    would need a C++ toolchain). Imported here with torch.compile a no-op for the length of the
    import, unless something imported Megatron already; jit_fuser keeps the no-op, so modules
    imported later decorate with it too. wandb, which megatron.core imports for its inference
    context's logging (0.34 s, 21 MB), is hidden from that import; the run's logger imports it
    when logging.backends asks for it."""
    if "megatron.core" in sys.modules:
        return
    compile_, hidden = torch.compile, [name for name in ("wandb",) if name not in sys.modules]
    torch.compile = _eager
    sys.modules.update(dict.fromkeys(hidden))  # None: an ImportError, which Megatron expects
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = compile_
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


def activate_cpu_shim() -> None:
    """Patch torch.cuda's CPU-hostile calls and megatron's RNG tracker for this process (Megatron
    imported without its compiled fusions when it is not yet: import_megatron_eager)."""
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
    import_megatron_eager()
    import torch.distributed as dist
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm
    from megatron.core.transformer.moe import moe_utils
    from torch.autograd.function import BackwardCFunction

    mode = _CudaToCpu()
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
        (torch.cuda, "Stream", _NullStream),
        (torch.cuda, "Event", _NullEvent),
        (dist, "all_to_all_single", _all_to_all_single_with_list_splits(dist.all_to_all_single)),
        (
            torch_norm.WrappedTorchNorm,
            "__new__",
            staticmethod(_norm_allowing_sequence_parallel(torch_norm.WrappedTorchNorm.__new__)),
        ),
        (BackwardCFunction, "apply", _backward_in_mode(BackwardCFunction.apply, mode)),
    ]
    if not hasattr(moe_utils, "te_general_gemm"):  # imported only with TE: the router's GEMM falls back to torch
        patches.append((moe_utils, "te_general_gemm", None))
    _state["originals"] = [(owner, name, getattr(owner, name, _MISSING)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    mode.__enter__()
    _state["mode"] = mode


def deactivate_cpu_shim() -> None:
    """Undo activate_cpu_shim (tests)."""
    if not _state:
        return
    _state["mode"].__exit__(None, None, None)
    for owner, name, original in _state["originals"]:
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _state.clear()


def cpu_shim_active() -> bool:
    return bool(_state)
