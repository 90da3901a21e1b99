"""The local spec's core attention in torch's fused kernel (models/local_attention.py) against
Megatron-Core's own DotProductAttention: the same outputs and gradients (grouped-query heads, the
causal mask Megatron builds, a packed row's block-diagonal mask, MLA's narrower values, query-key
layer scaling, bf16), the packed mask made once for all the layers, and every family's built model
running it but gpt-oss (sink logits and windows: Megatron's softmax)."""

import socket

import pytest
import torch

from bapo_megatron.config import load_config
from bapo_megatron.models import FAMILIES
from bapo_megatron.models.local_attention import additive, sdpa_attention
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.trainer.packing import block_causal_mask


@pytest.fixture
def world(monkeypatch):
    """A world of one in this process (tests/conftest.py takes it down after the test)."""
    from bapo_megatron.trainer.cpu_shim import activate_cpu_shim
    from bapo_megatron.trainer.parallel import init_distributed, init_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    activate_cpu_shim()
    init_distributed()
    cfg = load_config(None, [])
    init_model_parallel(cfg.parallel, cfg.seed)
    return cfg


def _pair(heads: int, groups: int, dim: int, value_dim: int, scaled: bool, dtype: torch.dtype):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=heads * dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=dim,
        apply_query_key_layer_scaling=scaled,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        attention_dropout=0.0,
        use_cpu_initialization=True,
    )
    ours, megatrons = (c(config, 3, AttnMaskType.causal, "self") for c in (sdpa_attention(), DotProductAttention))
    for module in (ours, megatrons):
        module.hidden_size_per_partition = heads * value_dim  # MLA's (LatentCoreAttention sets it so)
    return ours, megatrons


CASES = {  # heads, query groups, q/k dim, v dim, query-key layer scaling, dtype, packed
    "gqa-causal": (4, 2, 32, 32, False, torch.float32, False),
    "mha-packed": (4, 4, 16, 16, False, torch.float32, True),
    "gqa4-packed": (8, 2, 16, 16, True, torch.float32, True),
    "mla-values": (4, 4, 24, 16, False, torch.float32, False),
    "bf16-packed": (4, 2, 32, 32, False, torch.bfloat16, True),
}


@pytest.mark.parametrize("case", CASES)
def test_the_fused_kernel_is_megatrons_attention(world, case):
    heads, groups, dim, value_dim, scaled, dtype, packed = CASES[case]
    ours, megatrons = _pair(heads, groups, dim, value_dim, scaled, dtype)
    tokens, rows = (96, 1) if packed else (24, 3)
    mask = block_causal_mask(torch.tensor([0, 30, 31, 70, 96], dtype=torch.int32), tokens) if packed else None
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(tokens, rows, n, d, generator=g).to(dtype).requires_grad_()
        for n, d in ((heads, dim), (groups, dim), (groups, value_dim))
    )
    grad_out = torch.randn(tokens, rows, heads * value_dim, generator=g).to(dtype)
    results = []
    for module in (ours, megatrons):
        out = module(q, k, v, mask)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad_out)))
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        error = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert error < tolerance, (name, error)  # a mask or scale off by anything is O(1)


def test_a_packed_rows_mask_is_made_once_for_all_its_layers(world):
    """The kernel keeps the additive mask for backward: every layer of a micro-batch keeps the same
    one (the kernel would otherwise convert and keep the boolean mask anew in each layer), and a new
    micro-batch's mask makes a new one."""
    ours, _ = _pair(4, 2, 16, 16, False, torch.float32)
    mask = block_causal_mask(torch.tensor([0, 10, 40], dtype=torch.int32), 40)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    x = torch.randn(40, 1, 4, 16, requires_grad=True)
    kv = torch.randn(40, 1, 2, 16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for _ in range(3):
            h = ours(h, kv, kv, mask).view(40, 1, 4, 16)
    masks = {t.untyped_storage().data_ptr() for t in kept if t.shape == (1, 1, 40, 40)}
    assert len(masks) == 1
    made = additive(mask, torch.float32)
    assert made.untyped_storage().data_ptr() in masks
    assert torch.equal(made == 0, ~mask) and torch.isinf(made[mask]).all()
    other = mask.clone()
    assert additive(other, torch.float32).untyped_storage().data_ptr() != made.untyped_storage().data_ptr()


def test_every_familys_local_model_runs_the_fused_kernel_but_gpt_oss(world):
    from bapo_megatron.trainer import megatron_config as mc

    cfg = world
    for name, family in sorted(FAMILIES.items()):
        spec = tiny_spec(name)
        model = mc.build_gpt_model(spec, cfg.model, cfg.parallel, pre_process=True, post_process=True)
        cores = [m for n, m in model.named_modules() if n.endswith("core_attention")]
        assert cores, name  # a softmax-attention layer in every tiny model
        fused = [isinstance(m, sdpa_attention()) for m in cores]
        assert all(fused) == family.local_attention_fused and any(fused) == family.local_attention_fused, name
