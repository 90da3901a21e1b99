"""Canary: the CPU shim is pinned to one megatron-core; this fails loudly when upstream moves."""

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bapo_megatron.trainer import cpu_shim

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for machines without CUDA")


def test_megatron_core_version_is_the_one_the_shim_was_written_for():
    assert cpu_shim.megatron_core_version() == cpu_shim.SUPPORTED_MEGATRON_CORE


def test_patched_call_sites_still_exist_and_still_assume_cuda():
    for module, names in cpu_shim.PATCHED_CALL_SITES.items():
        mod = importlib.import_module(module)
        for name in names:
            assert hasattr(mod, name), f"{module}.{name} is gone: re-check the CPU shim"
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    assert "torch.cuda.current_device()" in inspect.getsource(rotary_pos_embedding.RotaryEmbedding.get_emb)
    assert "torch.cuda.synchronize()" in inspect.getsource(p2p_communication)
    assert 'device="cuda"' in inspect.getsource(schedules)
    from megatron.core.optimizer import clip_grads

    source = inspect.getsource(clip_grads.clip_grad_by_total_norm_fp32)
    assert "torch.cuda.FloatTensor" in source and "max_norm / (total_norm + 1.0e-6)" in source


def test_cpu_clipping_matches_megatron_formula():
    grads = [torch.randn(5), torch.randn(3, 2)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = torch.sqrt(sum((g**2).sum() for g in grads)).item()
    cpu_shim._clip_grad_by_total_norm_cpu(params, max_norm=0.5, total_norm=total)
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * (0.5 / (total + 1e-6)))
    cpu_shim._clip_grad_by_total_norm_cpu(params, max_norm=1e9, total_norm=total)  # no-op above the norm
    for p, g in zip(params, grads, strict=True):
        torch.testing.assert_close(p.grad, g * (0.5 / (total + 1e-6)))


def test_shim_sends_cuda_placements_to_cpu_and_undoes_itself():
    cpu_shim.activate_cpu_shim()
    try:
        assert cpu_shim.cpu_shim_active()
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
        assert torch.ones(1).to(torch.cuda.current_device()).device.type == "cpu"
        torch.cuda.synchronize()
        state = torch.cuda.get_rng_state()
        a = torch.rand(3)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(3), a)
    finally:
        cpu_shim.deactivate_cpu_shim()
    assert not cpu_shim.cpu_shim_active()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")


def test_moe_call_sites_still_assume_cuda_or_te():
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    assert "torch.cuda.Stream()" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher.__init__)
    assert "record_event()" in inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher)
    assert "te_general_gemm is not None" in inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    assert "torch.distributed.all_to_all_single" in inspect.getsource(mappings._AllToAll.forward)
    assert "as_numpy" in inspect.getsource(moe_utils.maybe_move_tensor_to_cpu)
    from megatron.core.transformer import torch_norm

    assert "not config.sequence_parallel" in inspect.getsource(torch_norm.WrappedTorchNorm)


def test_moe_shims_stream_event_and_splits():

    cpu_shim.activate_cpu_shim()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        stream.record_event().synchronize()
        assert cpu_shim._split_list(torch.tensor([2, 1])) == [2, 1] and cpu_shim._split_list(None) is None

    finally:
        cpu_shim.deactivate_cpu_shim()
    from megatron.core.transformer.moe import moe_utils

    assert not hasattr(moe_utils, "te_general_gemm")  # undone: back to what upstream left


class _AllocatesInBackward(torch.autograd.Function):
    """Like the MoE all-to-all: its backward makes a buffer on `torch.cuda.current_device()`."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + torch.zeros(grad.shape, device=torch.cuda.current_device())


def test_custom_backwards_run_in_the_mode_under_megatron_checkpoint():
    """Megatron's full recompute reruns the forward and then backpropagates with torch.autograd.backward,
    a torch function: its handler (the mode's own) runs with the mode off, so the custom backwards
    under it would place on CUDA; the shim puts the mode back around every custom backward."""
    from megatron.core.tensor_parallel import random as mrandom
    from torch.autograd.function import BackwardCFunction

    assert "torch.autograd.backward(outputs, args)" in inspect.getsource(mrandom.CheckpointFunction.backward)
    original = BackwardCFunction.apply
    cpu_shim.activate_cpu_shim()
    try:
        x = torch.ones(3, requires_grad=True)
        mrandom.checkpoint(_AllocatesInBackward.apply, False, x).sum().backward()  # Tensor.backward: also a handler
        torch.testing.assert_close(x.grad, torch.full((3,), 2.0))
    finally:
        cpu_shim.deactivate_cpu_shim()
    assert BackwardCFunction.apply is original


EAGER_PROBE = """
import sys
import torch
from bapo_megatron.trainer.cpu_shim import activate_cpu_shim

activate_cpu_shim()
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu

assert torch.compile.__module__.startswith("torch"), "torch.compile left patched"
assert jit.jit_fuser(len) is len and not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable")
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "wandb") if m in sys.modules))
import wandb  # the run's logger can still import it
"""


def test_megatron_imports_without_compiling_its_fusions():
    """activate_cpu_shim imports Megatron with torch.compile a no-op for the import (Megatron's own
    disable_jit_fuser state): its fusions stay plain functions and torch._dynamo / torch._inductor
    are never imported (1.4 s and ~70 MB a process), nor wandb (importable after); Megatron still
    sets torch.compile there."""
    from megatron.core import jit

    assert "jit_fuser = torch.compile" in inspect.getsource(jit.enable_jit_fuser)
    done = subprocess.run([sys.executable, "-c", EAGER_PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", done.stdout
