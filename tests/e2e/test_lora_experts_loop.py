"""The tiny Qwen3-MoE with LoRA on its routed experts (model.lora.experts) through the whole loop at
EP 2: the experts' adapters trained where their experts live, sent alone to the embedded engine every
step (model.lora.sync=adapter, SGLang's per-expert names), which applies them in its forward: after
every sync its log-probs are the trainer's (the probe and the first update's mismatch within 1e-5);
the final checkpoint converted to a HF directory has the adapters merged into the experts."""

import subprocess
import sys

import pytest
import torch

from tests.helpers import make_hf_model
from tests.online import ROOT, args, metrics, no_engine_left, torchrun, train, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-experts")
    make_hf_model(root, "moe", ("qwen3_moe", 2, False))
    return write_task(root / "task", 64, root / "moe")


def test_expert_lora_trains_at_ep2_and_the_engine_serves_it(task, tmp_path):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    extra = ("parallel.expert=2", "algo.routing_replay=true", "rollout.mode=sync", "rollout.sync.check_every=1")
    extra += ("model.lora.rank=8", "model.lora.alpha=16", "model.lora.experts=true")
    train(args(task, run, 2, *extra), launcher=torchrun(2))
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["sync/probe_logprob_gap"] <= 1e-5 and m["rollout_corr/train_rollout_logprob_abs_diff"] <= 1e-5, m
        assert m["sync/bytes"] == m["sync/adapter_bytes"] > 0, m  # the adapters alone, every step
    no_engine_left(tmp_path)

    out = tmp_path / "hf"
    convert = [sys.executable, "tools/convert_checkpoint.py", "mcore-to-hf", "--mcore", str(run / "ckpt")]
    convert += ["--out", str(out), "--hf-template", str(task / "m"), "--no-progress"]
    subprocess.run(convert, cwd=ROOT, check=True, timeout=600)
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(task / "m", dtype=torch.float32).state_dict()
    moved = [k for k in trained if not torch.equal(trained[k], initial[k])]
    assert any("mlp.experts.gate_up_proj" in k for k in moved) and any("mlp.experts.down_proj" in k for k in moved)
    assert not any("mlp.gate.weight" in k or "norm" in k for k in moved), moved
