"""The whole loop for the new families: a tiny DeepSeek-V3 (latent attention, grouped sigmoid
routing) and a tiny Qwen3.5-MoE (Gated DeltaNet hybrid with routed experts), each as
`python -m bapo_megatron.tasks` writes it, trained under torchrun at EP 2 with the engine's routes
replayed, generating asynchronously with partial rollout (rollout.pause_mode abort: at each weight
update the requests in flight come back with their tokens and continue under the new weights from
prompt + partial response), then exported to a HF directory that transformers loads.

One run per family, with the fewest steps that show each property:
- step 1 trains on tokens of the weights it holds: the engine's log-probs are the trainer's and its
  routers pick the trainer's experts; step 2's probe after the first update agrees too, and so do
  every step's tokens sampled by the weights trained on, continued samples' included (a continued
  sample's routes are the latest engine run's, prefix too: rollout/buffer.py; before, the trainer
  replayed the prefix's first routes where the engine had run it again under the new weights'
  routes, 7e-4 to 4e-3 for Qwen3.5-MoE);
- DeepSeek-V3 generates asynchronously (rollout.pause_mode abort: the requests in flight at an update
  come back with their tokens and continue under the new weights): it ran ahead (tokens one version
  old); whether an update finds a request generating depends on timing, so this run is not asked
  for a continued sample;
- Qwen3.5-MoE runs synchronous partial rollout (a token budget of 16 and twice the groups in flight):
  the groups a step does not take are cut and continue next step under the new weights, so a trained
  sample carries tokens of two versions in every run (for the hybrid, the engine rebuilds the
  recurrent state of the continuation from its tokens; tests/e2e/test_engine_recurrent.py checks
  that continuation token for token);
- every trained sample carried routes for each position;
- the run's last checkpoint, converted with mcore-to-hf, loads in transformers without remote code
  and gives the logits of the trainer's weights (`convert_checkpoint.py verify`, 1e-5), with the
  routers and experts moved from the task model's.
"""

import json
import subprocess
import sys

import pytest
import torch

from bapo_megatron.tasks import write_task
from tests.online import PORTS, REWARD, ROOT, engine_port, metrics, no_engine_left, torchrun, train

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 3
SAMPLES = 2 * 12
"""A step's samples: 2 prompts x 12."""
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


MODES = {
    "deepseek_v3": ("rollout.mode=async", "rollout.pause_mode=abort"),
    "qwen3_5_moe_text": (
        "rollout.mode=sync",
        "rollout.partial.enabled=true",
        "rollout.partial.token_budget=16",
        "rollout.oversample=2",
    ),
}
"""How each family generates: asynchronously, or synchronous partial rollout (continuations by design)."""


def loop_args(task: dict, reward: str, run, architecture: str) -> list[str]:
    port = engine_port()
    PORTS.setdefault(run, []).append(port)
    return [
        f"model.hf_path={task['model']}",
        f"data.path={task['train']}",
        f"reward.function={reward}:even",
        f"steps={STEPS}",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=12",
        "rollout.sampling.max_new_tokens=32",
        *MODES[architecture],
        "rollout.max_staleness=1",
        "rollout.sync.check_every=2",  # the probe at the second update (one at the first would wait in the queue)
        "rollout.engines.max_batch=1",
        f"rollout.engines.port={port}",
        "parallel.expert=2",
        "parallel.max_tokens_per_microbatch=1024",
        "algo.routing_replay=true",
        "optimizer.lr=1e-3",
        f"checkpoint.dir={run / 'ckpt'}",
        f"run_dir={run}",
        "logging.backends=[jsonl]",
        f"logging.samples={SAMPLES}",
    ]


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_family_trains_at_ep2_with_replayed_routes_async_or_partial_and_exports_to_hf(architecture, tmp_path):
    from transformers import AutoModelForCausalLM

    task = write_task("addition", tmp_path / "task", train=64, heldout=2, architecture=architecture)
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "run"
    train(loop_args(task, str(tmp_path / "reward.py"), run, architecture), launcher=torchrun(2))
    steps = metrics(run)
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    first = steps[0]
    assert first["rollout_corr/train_rollout_logprob_abs_diff_same_version"] <= 1e-5, first
    assert first["moe/router_disagreement"] <= 0.01, first
    assert steps[1]["sync/probe_logprob_gap"] <= 1e-5, steps[1]
    hf = json.loads((task["model"] / "config.json").read_text())
    most = hf.get("n_routed_experts", hf.get("num_experts")) / hf["num_experts_per_tok"]  # every token in one expert
    for m in steps:
        same = m.get("rollout_corr/train_rollout_logprob_abs_diff_same_version")  # None: all tokens older (async)
        assert same is None or same <= 1e-5, m
        assert m["moe/routed_samples_share"] == 1.0 and "moe/router_disagreement" in m, m
        assert 1.0 <= m["moe/load_max"] <= most + 1e-6, m
        assert m["rollout/engine_failures"] == 0 and m["rollout/token_staleness_max"] <= 1, m
    samples = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(samples) == STEPS * SAMPLES
    if "rollout.mode=async" in MODES[architecture]:
        assert any(m["rollout/token_staleness_max"] == 1 for m in steps)  # it ran ahead
    else:
        continued = [s for s in samples if s["version_min"] < s["version_max"]]
        assert continued, "no trained sample was continued across a weight update"
    no_engine_left(tmp_path)

    out = tmp_path / "hf"
    convert = [sys.executable, "tools/convert_checkpoint.py", "mcore-to-hf", "--mcore", str(run / "ckpt")]
    subprocess.run([*convert, "--out", str(out), "--no-progress"], cwd=ROOT, check=True, timeout=600)
    # verify takes the run's checkpoint.dir, as mcore-to-hf does: the step a resume would load
    verify = [sys.executable, "tools/convert_checkpoint.py", "verify", "--hf", str(out), "--mcore", str(run / "ckpt")]
    checked = subprocess.run(
        [*verify, "--tolerance", "1e-5", "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["architectures"] == [ARCHITECTURES[architecture]]
    load = dict(dtype=torch.float32, trust_remote_code=False)
    trained = AutoModelForCausalLM.from_pretrained(out, **load).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(task["model"], **load).state_dict()
    assert set(trained) == set(initial)
    moved = [k for k in trained if not torch.equal(trained[k], initial[k])]
    assert any(".experts." in k for k in moved) and any("mlp.gate." in k for k in moved), moved
