"""A tiny Qwen3-MoE with LoRA through the whole loop: HF weights in, adapters trained at EP=2 (data
parallel 2 for them) under torchrun with the engine's routes replayed, the adapters alone sent to the
engine every step (model.lora.sync=adapter), and the final checkpoint converted to a HF directory
that transformers loads (the adapters merged; the experts and routers, not adapted, as they came).
With model.lora.experts every expert's gate_up_proj and down_proj are adapted too: they move in the
export, the routers and norms still do not.

The embedded engine and the trainer run the same fp32 weights: after every sync the engine's
log-probs are the trainer's (the probe and the first update's mismatch within 1e-5, partial
rollout continuing samples across requests), the routes it returns make a router disagreement
near zero (the engine and the trainer pick the same experts), and every trained sample carried
routes for each of its positions (moe/router_disagreement is reported only where they were known).
"""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import make_hf_model
from tests.online import ROOT, args, metrics, no_engine_left, torchrun, train, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    make_hf_model(root, "moe", ("qwen3_moe", 2, False))
    return write_task(root / "task", 64, root / "moe")


@pytest.mark.parametrize("experts", [False, True], ids=["attention-and-dense", "experts-too"])
def test_qwen3_moe_lora_trains_at_ep2_with_replayed_routes_and_exports_to_hf(task, tmp_path, experts):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    extra = ("parallel.expert=2", "algo.routing_replay=true", "rollout.mode=sync", "rollout.sync.check_every=1")
    extra += ("model.lora.rank=8", "model.lora.alpha=16", f"model.lora.experts={str(experts).lower()}")
    train(args(task, run, 2, *extra), launcher=torchrun(2))
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["sync/probe_logprob_gap"] <= 1e-5 and m["rollout_corr/train_rollout_logprob_abs_diff"] <= 1e-5, m
        assert m["rollout_corr/train_rollout_logprob_abs_diff_same_version"] <= 1e-5, m  # sync: all this version's
        assert m["moe/router_disagreement"] <= 0.01 and m["moe/routed_samples_share"] == 1.0, m
        assert 1.0 <= m["moe/load_max"] < 4.0, m
        assert m["sync/bytes"] == m["sync/adapter_bytes"] > 0, m  # the adapters alone, every step
    no_engine_left(tmp_path)

    out = tmp_path / "hf"
    convert = [sys.executable, "tools/convert_checkpoint.py", "mcore-to-hf", "--mcore", str(run / "ckpt")]
    convert += ["--out", str(out), "--hf-template", str(task / "m"), "--no-progress"]
    subprocess.run(convert, cwd=ROOT, check=True, timeout=600)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    start = AutoModelForCausalLM.from_pretrained(task / "m", dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    trained, initial = exported.state_dict(), start.state_dict()
    assert set(trained) == set(initial)
    moved = [k for k in trained if not torch.equal(trained[k], initial[k])]
    assert any("self_attn.q_proj" in k for k in moved), moved  # the adapters, merged
    assert not any("mlp.gate.weight" in k or "norm" in k for k in moved), moved
    if experts:
        assert any("mlp.experts.gate_up_proj" in k for k in moved) and any("mlp.experts.down_proj" in k for k in moved)
    else:
        assert not any("experts" in k for k in moved), moved
