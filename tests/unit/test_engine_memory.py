"""An SGLang server's cache for the hybrid and latent families (Family.engine_cache_bytes,
engine_state_bytes; trainer/memory/engine.py): KV in the full-attention layers only, a Gated
DeltaNet layer's state per request as SGLang 0.5.23's own code sizes it (its wheel), and the dry
run's SGLang line saying both."""

import re
import types
from pathlib import Path

import pytest
import torch

from bapo_megatron.models import family_of
from bapo_megatron.models.spec import ModelSpec
from bapo_megatron.trainer.memory.engine import MAMBA_FULL_MEMORY_RATIO, engine_cache

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def qwen27b() -> ModelSpec:
    return ModelSpec.from_hf_dir(EXAMPLES / "qwen3.5-27b" / "shape")


def test_a_hybrid_caches_keys_and_values_in_its_full_attention_layers_only(qwen27b):
    """Qwen3.5-27B at SGLang TP 4: 16 of its 64 layers are full attention, 4 key/value heads of 256,
    one a rank: 2 x 16 x 1 x 256 x 2 bytes (every layer counted, as before: 4x that)."""
    assert len(qwen27b.linear_attention.layers) == 48 and qwen27b.num_kv_heads == 4
    assert family_of(qwen27b).engine_cache_bytes(qwen27b, 4) == 2 * 16 * 256 * 2


def test_sglang_replicates_key_value_heads_beyond_the_ranks():
    """Qwen3.5-35B-A3B's 2 key/value heads at TP 4: each rank caches one (SGLang's
    max(1, heads // TP)), in its 10 full-attention layers."""
    spec = ModelSpec.from_hf_dir(EXAMPLES / "qwen3.5-35b-a3b" / "shape")
    assert family_of(spec).engine_cache_bytes(spec, 4) == 2 * 10 * 1 * 256 * 2


@pytest.mark.parametrize("tp", [1, 4])
def test_the_recurrent_state_is_sglangs_own_count(qwen27b, wheel, tp):
    """engine_state_bytes against SGLang 0.5.23's Qwen3NextConfig.mamba2_cache_params (Qwen3.5's
    config class inherits it) and its mamba_cache_per_req, run from the wheel on the model's shape."""
    from tests.sglang_wheel import load_defs

    wanted = {
        "distributed/utils.py": ["ensure_divisibility", "divide"],
        "configs/mamba_utils.py": [
            "extra_groups_for_head_shards",
            "Mamba2StateDType",
            "BaseLinearStateParams",
            "Mamba2StateShape",
            "Mamba2CacheParams",
        ],
        "configs/qwen3_next.py": ["Qwen3NextConfig.mamba2_cache_params"],
    }
    la = qwen27b.linear_attention
    ns = load_defs(
        wheel,
        wanted,
        {
            "ABC": object,
            "np": __import__("numpy"),
            "torch": torch,
            "_is_cpu": False,
            "linear_attn_tp_size": lambda: tp,
            # the released config's mamba_ssm_dtype float32, SGLang's conv dtype default bf16
            "mamba2_state_dtype": lambda config: ns["Mamba2StateDType"](conv=torch.bfloat16, temporal=torch.float32),
        },
    )
    config = types.SimpleNamespace(
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_num_key_heads=la.num_key_heads,
        linear_num_value_heads=la.num_value_heads,
        linear_conv_kernel_dim=la.conv_kernel_dim,
        linear_layer_ids=list(la.layers),
    )
    params = ns["mamba2_cache_params"](config)
    assert family_of(qwen27b).engine_state_bytes(qwen27b, tp) == params.mamba_cache_per_req


def test_the_state_pools_share_is_sglangs_default(wheel):
    from tests.sglang_wheel import source

    fields = source(wheel, "arg_groups/fields/schedule.py")
    block = fields[fields.index("mamba_full_memory_ratio:") :]
    assert float(re.search(r"fallback=([\d.]+)", block).group(1)) == MAMBA_FULL_MEMORY_RATIO


def test_the_cache_splits_into_request_slots_and_kv_tokens(qwen27b):
    """40 GiB: the state pool takes 0.9 / 1.9 of it in whole request slots, one of them SGLang's
    padding slot; the KV pool the rest. A model without recurrent layers: all KV, no slot count."""
    budget, per_request = 40 << 30, family_of(qwen27b).engine_state_bytes(qwen27b, 4)
    cache = engine_cache(qwen27b, 4, budget)
    slots = int((budget * 0.9 / 1.9 - per_request) // per_request)
    assert (cache.requests, cache.state_bytes) == (slots, (slots + 1) * per_request)
    assert cache.tokens == (budget - cache.state_bytes) // (2 * 16 * 256 * 2)
    moonlight = ModelSpec.from_hf_dir(EXAMPLES / "moonlight-16b-a3b" / "shape")
    plain = engine_cache(moonlight, 2, budget)
    assert plain.requests is None and plain.tokens == budget // (27 * (512 + 64) * 2)


def test_the_dry_runs_sglang_line_says_tokens_and_concurrent_requests(capsys, monkeypatch):
    from bapo_megatron.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    main(["examples/qwen3.5-27b/config.yaml", "--dry-run", "--world-size=32"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("each SGLang server GPU"))
    kv, tokens = re.search(r"KV cache ([\d.]+) GiB = ([\d,]+) tokens \(its full-attention layers'\)", line).groups()
    state, requests = re.search(r"([\d.]+) GiB = ([\d,]+) concurrent requests", line).groups()
    assert int(tokens.replace(",", "")) == pytest.approx(float(kv) * 2**30 / 16384, rel=1e-3)
    slots = int(requests.replace(",", ""))
    assert slots > 0 and "36.7 MiB a request" in line  # 48 layers x (2,560 x 3 x 2 + 12 x 128 x 128 x 4) B
    assert float(state) == pytest.approx((slots + 1) * 38_486_016 / 2**30, abs=0.01)
