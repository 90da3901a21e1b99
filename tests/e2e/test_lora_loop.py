"""A LoRA run through the whole loop (model.lora.rank=4, the embedded engine, synchronous, partial
rollout continued across versions): after the base at the start, every sync sends the engine the
adapters alone (model.lora.sync adapter: their bytes, far fewer than the model's, checksummed), which
it serves under each version's name with what the trainer computes (the probe, with the adapter on,
within 1e-5 after every sync); the checkpoint holds the adapters and their Adam state alone, and
names the base (lora_base.json); mcore-to-hf merges them onto that base, whose logits transformers
gives as the trainer does (`verify`), and --peft-adapter writes the adapters that peft loads onto the
base with the same logits."""

import subprocess
import sys

import pytest
import torch

from bapo_megatron.common.hf_io import HFCheckpoint
from bapo_megatron.config.lora import LoRAConfig
from bapo_megatron.models.lora import is_adapter
from bapo_megatron.trainer.base_identity import recorded_base
from bapo_megatron.trainer.safe_load import read_metadata
from bapo_megatron.weights.lora_sync import adapter_update_bytes
from bapo_megatron.weights.mcore_io import McoreCheckpoint
from tests.online import MODEL, ROOT, args, metrics, train, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _convert(*argv: str) -> str:
    tool = [sys.executable, str(ROOT / "tools" / "convert_checkpoint.py")]
    done = subprocess.run([*tool, *argv, "--no-progress"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def test_lora_run_sends_the_adapters_alone_and_exports_merged_and_peft(hf_model, tmp_path):
    import peft
    import transformers

    task = write_task(tmp_path / "task", 16, hf_model(*MODEL))
    run = tmp_path / "run"
    lora = ("rollout.mode=sync", "rollout.sync.check_every=1", "model.lora.rank=4")
    train(args(task, run, 2, *lora))
    steps = metrics(run)
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["sync/probe_logprob_gap"] <= 1e-5 for m in steps), [m["sync/probe_logprob_gap"] for m in steps]
    base = HFCheckpoint(task / "m")
    adapters = adapter_update_bytes(base.spec, LoRAConfig(rank=4), torch.float32)
    model = sum(base[name].numel() * base[name].element_size() for name in base.files)
    assert all(m["sync/bytes"] == m["sync/adapter_bytes"] == adapters for m in steps), [m["sync/bytes"] for m in steps]
    assert all(m["sync/verified"] == 1.0 for m in steps) and adapters * 10 < model

    step = run / "ckpt" / "step_00000002"
    saved = {k: m for k, m in read_metadata(step).state_dict_metadata.items() if hasattr(m, "size")}  # tensors
    adam = [k for k in saved if k.startswith("optimizer.state.")]
    assert adam and all(is_adapter(k) for k in adam), [k for k in adam if not is_adapter(k)][:3]
    model = [k for k in saved if not k.startswith("optimizer.")]
    assert model and all(is_adapter(k) for k in model), [k for k in model if not is_adapter(k)][:3]  # no base
    assert recorded_base(step).path == str((task / "m").resolve())  # the base: from model.hf_path at every start
    stored = McoreCheckpoint(step)
    assert stored.lora is not None and stored.lora.rank == 4 and not stored.holds_base

    _convert(
        "mcore-to-hf",
        "--mcore",
        str(run / "ckpt"),
        "--out",
        str(tmp_path / "hf"),
        "--peft-adapter",
        str(tmp_path / "peft"),
    )
    assert "ok tolerance" in _convert("verify", "--hf", str(tmp_path / "hf"), "--mcore", str(step))
    merged = HFCheckpoint(tmp_path / "hf")
    changed = {name for name in base.files if not torch.equal(merged[name], base[name])}
    assert changed == {
        n for n in base.files if n.endswith(tuple(f"{p}.weight" for p in PROJECTIONS))
    }  # every projection

    ids = torch.randint(base.spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        theirs = load(str(tmp_path / "hf"), dtype=torch.float32).eval()(ids).logits
        with_adapter = peft.PeftModel.from_pretrained(
            load(str(task / "m"), dtype=torch.float32), str(tmp_path / "peft")
        )
        ours = with_adapter.eval()(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)

    train(args(task, run, 3, *lora))  # resumed: the base from model.hf_path, adapters and Adam state from step 2
    resumed = metrics(run)
    assert [m["step"] for m in resumed] == [1, 2, 3] and resumed[-1]["sync/probe_logprob_gap"] <= 1e-5
