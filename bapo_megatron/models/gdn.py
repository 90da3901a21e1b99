"""Megatron-Core 0.16.1's Gated DeltaNet and Qwen3.5's norms as local (non-TE) modules, with its
CPU obstacles worked around here, for the hybrid families (models/qwen3_5.py) only.

- `GatedDeltaNet` refuses to be built without fla (flash-linear-attention), although the rule has
  a torch version (`torch_chunk_gated_delta_rule`) and only `l2norm` is missing: where fla is not
  installed, `torch_fallback()` gives that module the torch rule and transformers' l2norm (the
  names fla would have defined; nothing else reads them), for the rest of the process, and
  `TorchGatedDeltaNet` builds without the check. With fla installed the module keeps fla's
  kernels. On a CUDA machine without fla the torch rule is far slower than fla's: one warning says so.
- Its `_apply_gated_norm` is `torch.compile`d at import; on CPU that compiles per shape, so the
  subclass runs the same few operations uncompiled, with fla or without.
- Megatron's torch norm refuses the zero-centred RMSNorm (`(1 + w)`, Qwen3.5's every norm but the
  gated one): `ZeroCenteredRMSNorm`, transformers' arithmetic, marked `sequence_parallel` as TE's.
- The gated norm inside the delta-rule layer sees this rank's value heads only, so its weight's
  gradient is a partial sum at TP > 1 that Megatron does not reduce (its name is no q/k norm's):
  `GatedHeadRMSNorm` sums it over the tensor-parallel ranks in its backward.
- A TP rank's `in_proj` is [q_r; k_r; v_r; z_r; b_r; a_r] and its `conv1d` [q_r; k_r; v_r]: no slice
  of the whole tensor. Megatron's checkpoints split them into parts (recipes.Parts); the live
  export reads the parts' sizes from each shard's `tp_parts` (weights/export.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch

SUPPORTED_MEGATRON_CORE = "0.16.1"


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla's l2norm as transformers computes it (its torch fallback for Qwen3.5)."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def torch_fallback() -> bool:
    """Give Megatron's gated_delta_net module the torch delta rule and l2norm where fla is missing,
    for the rest of the process (a warning the first time when CUDA is there: a GPU run on the torch
    reference kernel); True when it did (or had), False when fla is installed. Pinned to
    megatron-core 0.16.1's module (the canary in tests/dist/test_family_qwen3_5.py checks the names
    it relies on)."""
    import importlib.metadata
    import warnings

    from megatron.core.ssm import gated_delta_net as gdn

    if gdn.HAVE_FLA and gdn.chunk_gated_delta_rule is not gdn.torch_chunk_gated_delta_rule:
        return False
    version = importlib.metadata.version("megatron-core")
    if version != SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"the Gated DeltaNet fallback without fla is written for megatron-core {SUPPORTED_MEGATRON_CORE}, found "
            f"{version}: re-check bapo_megatron/models/gdn.py against its ssm/gated_delta_net.py (or install fla)"
        )
    if gdn.chunk_gated_delta_rule is not gdn.torch_chunk_gated_delta_rule and torch.cuda.is_available():
        warnings.warn(
            "Gated DeltaNet layers run megatron-core's torch reference delta rule (torch_chunk_gated_delta_rule): "
            "flash-linear-attention (fla) is not installed on this CUDA machine; install it for its kernels",
            stacklevel=2,
        )
    gdn.chunk_gated_delta_rule = gdn.torch_chunk_gated_delta_rule
    gdn.l2norm = l2norm
    return True


@contextlib.contextmanager
def _without_fla_check():
    from megatron.core.ssm import gated_delta_net as gdn

    had = gdn.HAVE_FLA
    gdn.HAVE_FLA = True
    try:
        yield
    finally:
        gdn.HAVE_FLA = had


@functools.cache
def _gated_delta_net_class():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    class TorchGatedDeltaNet(GatedDeltaNet):
        """Megatron's GatedDeltaNet, built with or without fla, its gated norm uncompiled, and its
        part-by-part sharded parameters marked with their parts' sizes (`tp_parts`)."""

        def __init__(self, *args, **kwargs) -> None:
            with _without_fla_check():
                super().__init__(*args, **kwargs)
            tp, qk, v, heads = self.tp_size, self.qk_dim, self.v_dim, self.num_value_heads
            self.in_proj.weight.tp_parts = tuple(n // tp for n in (qk, qk, v, v, heads, heads))
            for param in self.conv1d.parameters():
                param.tp_parts = tuple(n // tp for n in (qk, qk, v))
            for param in (*self.conv1d.parameters(), self.dt_bias, self.A_log):
                param.partition_dim = 0  # Megatron marks them tensor-parallel without saying along which axis

        def _apply_gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
            dtype = x.dtype
            y = self.out_norm(x.reshape(-1, x.shape[-1]))
            y = y * self.act_fn(gate.reshape(-1, gate.shape[-1]).float())
            return y.to(dtype)

    return TorchGatedDeltaNet


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a (1 + weight) gain, weight zero at init (Qwen3.5's; TE's zero_centered_gamma),
    computed as transformers does: in fp32, the gain applied before the cast back."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # under sequence parallel a rank norms its slice of the tokens: Megatron sums the gradient
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedHeadRMSNorm(torch.nn.Module):
    """The delta-rule layer's per-head RMSNorm (weight ones at init, no zero centring), its gradient
    summed over the tensor-parallel ranks (each normalises its own value heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = copy_to_tensor_model_parallel_region(self.weight)  # identity; all-reduce of its gradient
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * y.to(dtype)


def gated_delta_net_spec():
    """The local ModuleSpec of the delta-rule layer (its input norm is the layer's own module)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    torch_fallback()
    return ModuleSpec(
        module=_gated_delta_net_class(),
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=GatedHeadRMSNorm, out_proj=RowParallelLinear
        ),
    )


__all__ = ["GatedHeadRMSNorm", "ZeroCenteredRMSNorm", "gated_delta_net_spec", "l2norm", "torch_fallback"]
