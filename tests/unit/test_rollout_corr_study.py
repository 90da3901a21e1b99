"""examples/rollout_corr_study: its quantised engine (values, names, determinism, the hook into the
engine core and into the engine's process), its grid, a run's record and the results table."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

STUDY = Path(__file__).resolve().parents[2] / "examples" / "rollout_corr_study"
sys.path.insert(0, str(STUDY))

import engine_quantization as eq  # noqa: E402

_spec = importlib.util.spec_from_file_location("rollout_corr_study_run", STUDY / "run.py")
study = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)  # its dataclass looks itself up there
_spec.loader.exec_module(study)


@pytest.mark.parametrize("levels", [1, 2, 3, 7])
def test_fake_quantise_holds_2_levels_plus_1_values_a_row_and_is_deterministic(levels):
    w = torch.randn(6, 40, generator=torch.Generator().manual_seed(levels))
    w[2] = 0.0
    q = eq.fake_quantise(w, levels)
    scale = w.abs().amax(-1, keepdim=True) / levels
    steps = q / torch.where(scale > 0, scale, 1.0)
    assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= levels + 1e-4
    assert torch.equal(q[2], torch.zeros(40))
    assert torch.allclose(q.abs().amax(-1), w.abs().amax(-1))  # each row's absmax is kept exactly
    assert ((q - w).abs() <= scale / 2 + 1e-6).all()  # rounding to the nearest value
    assert torch.equal(q, eq.fake_quantise(w.clone(), levels))  # deterministic
    assert torch.allclose(eq.fake_quantise(q, levels), q, atol=1e-6)  # a quantised weight stays as it is
    assert eq.fake_quantise(w.bfloat16(), levels).dtype == torch.bfloat16


def test_fake_quantise_refuses_bad_levels_and_vectors():
    for levels in (0, 128):
        with pytest.raises(ValueError, match="levels must lie in"):
            eq.fake_quantise(torch.ones(2, 2), levels)
    with pytest.raises(ValueError, match="2 or more dimensions"):
        eq.fake_quantise(torch.ones(3), 2)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("model.layers.0.self_attn.q_proj.weight", True),
        ("model.layers.0.mlp.gate_proj.weight", True),  # a dense MLP's gate projection, not a router
        ("model.layers.1.mlp.experts.3.down_proj.weight", True),
        ("model.layers.1.mlp.gate.weight", False),  # Qwen3-MoE's router
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
        ("model.layers.0.input_layernorm.weight", False),
        ("model.layers.0.self_attn.q_proj.bias", False),
    ],
)
def test_which_tensors_are_quantised(name, expected):
    assert eq.quantised(name) is expected


@pytest.fixture(scope="module")
def patched(hf_model):
    """A subclass of the embedded engine core patched as the study patches it (the real class untouched)."""
    from bapo_megatron.engines.embedded.core import EngineCore

    module = types.SimpleNamespace(EngineCore=type("StudyCore", (EngineCore,), {}))
    eq.patch_core(module, 2)
    return module.EngineCore, hf_model("qwen2-gqa2")


def _on_grid(tensor: torch.Tensor, levels: int) -> bool:
    w = tensor.float()
    steps = w / (w.abs().amax(-1, keepdim=True) / levels)
    return torch.allclose(steps, steps.round(), atol=0.05)


def test_the_patched_core_quantises_its_weights_at_start_and_every_update(patched):
    from bapo_megatron.engines.embedded.core import EngineCore

    core_class, model_dir = patched
    core, plain = core_class(model_dir), EngineCore(model_dir)
    state, exact = core.model.state_dict(), plain.model.state_dict()
    for name, tensor in state.items():
        if eq.quantised(name):
            assert _on_grid(tensor, 2) and not torch.equal(tensor, exact[name]), name
        else:
            assert torch.equal(tensor, exact[name]), name
    name = "model.layers.0.mlp.up_proj.weight"
    update = torch.randn_like(exact[name])
    core.load_weights([(name, update), ("model.norm.weight", exact["model.norm.weight"] * 2)])
    assert torch.equal(state[name], eq.fake_quantise(update, 2))
    assert torch.equal(state["model.norm.weight"], exact["model.norm.weight"] * 2)
    core_class.study_levels = None  # off again: updates load as sent
    try:
        core.load_weights([(name, update)])
        assert torch.equal(state[name], update)
    finally:
        core_class.study_levels = 2
    assert not hasattr(EngineCore, "study_levels")


@pytest.mark.slow
def test_the_engine_process_is_quantised_through_sitecustomize():
    """The way the study's runs reach the engine: a fresh process with run.py's environment."""
    env = {**study.engine_env(3), "PYTHONPATH": os.pathsep.join([str(STUDY), str(STUDY.parents[1])])}
    code = "import bapo_megatron.engines.embedded.core as c; print(c.EngineCore.study_levels)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "3"


def test_install_does_nothing_without_the_variable_and_refuses_a_bad_one(monkeypatch):
    finders = list(sys.meta_path)
    monkeypatch.delenv(eq.ENV, raising=False)
    assert eq.install() is None and sys.meta_path == finders
    for bad, match in (("two", "not a whole number"), ("0", "levels must lie in")):
        monkeypatch.setenv(eq.ENV, bad)
        with pytest.raises(ValueError, match=match):
            eq.install()
    assert sys.meta_path == finders


def test_engine_env_sets_the_levels_only_when_asked(monkeypatch):
    monkeypatch.setenv(eq.ENV, "5")
    assert eq.ENV not in study.engine_env(0)
    env = study.engine_env(2)
    assert env[eq.ENV] == "2" and env["PYTHONPATH"].split(os.pathsep)[0] == str(STUDY)


def test_the_grid_runs_every_correction_and_loss_on_both_models_and_moe_replay_off_for_two():
    arms = study.grid()
    assert len(arms) == len(set(arms)) == 2 * 2 * len(study.CORRECTIONS) + 2 * len(study.REPLAY_OFF)
    off = {(a.loss, a.correction) for a in arms if a.replay == "off"}
    assert off == {(loss, c) for loss in study.LOSSES for c in study.REPLAY_OFF}
    dense = study.Arm("dense", "-", "bapo", "geo_rs").overrides()
    assert "algo.loss=bapo" in dense and not any("routing_replay" in o for o in dense)
    assert "algo.routing_replay=False" in study.Arm("moe", "off", "ppo", "none").overrides()


def test_every_arms_command_is_a_config_the_trainer_accepts(tmp_path, monkeypatch):
    """The command each arm runs (the demo's shared regime, the study's, the arm's) loads as a config:
    a key mistyped in any of them is refused here, not after the warm start and 71 runs."""
    from bapo_megatron.config.loader import load_config

    monkeypatch.syspath_prepend(str(STUDY.parent))  # examples/: the demo's study_command
    commands = []
    monkeypatch.setattr(
        study.subprocess, "run", lambda command, **_: commands.append(command) or types.SimpleNamespace(returncode=0)
    )
    warm = {"task": {"model": "m", "train": "t.jsonl", "heldout": "h.jsonl"}, "sft": tmp_path / "sft"}
    args = types.SimpleNamespace(
        out=tmp_path, steps=6, prompts=8, samples=8, eval_prompts=50, quiet=True, levels=None, overrides=[]
    )
    for arm in study.grid():
        study.train(args, warm, arm, seed=0)
    for command in commands:
        config_at = next(i for i, part in enumerate(command) if part.endswith("rl.yaml"))
        config = load_config(command[config_at], command[config_at + 1 :])
        assert config.rollout.max_staleness == 2 and config.algo.updates_per_batch == 1
    assert len(commands) == len(study.grid())


def _rows(abs_diffs: list[float], accuracy: float) -> list[dict]:
    rows = [{"step": 0, "eval/greedy_acc": 0.3}]
    for step, diff in enumerate(abs_diffs, 1):
        rows.append({"step": step, "policy/entropy": 1.0, "rollout_corr/train_rollout_logprob_abs_diff": diff})
    rows[1]["rollout_corr/train_rollout_logprob_abs_diff_same_version"] = abs_diffs[0] / 2
    rows[-1]["eval/greedy_acc"] = accuracy
    return rows


def test_a_runs_record_and_the_table_of_medians_and_ranges():
    arm = study.Arm("moe", "on", "bapo", "token_tis")
    records = [study.summarise(_rows([0.1, 0.3], acc), arm, seed) for seed, acc in enumerate([0.2, 0.5, 0.3])]
    assert records[0]["abs_diff"] == pytest.approx(0.2) and records[0]["first_abs_diff"] == pytest.approx(0.05)
    assert records[0]["kl"] is None and records[1]["greedy_acc_start"] == 0.3 and records[1]["steps"] == 2
    records.append(study.summarise(_rows([0.4], 0.1), study.Arm("dense", "-", "ppo", "none"), 0))
    text = study.table(json.loads(json.dumps(records)), ["greedy_acc", "abs_diff", "kl"])
    lines = text.splitlines()
    assert lines[0] == "| model | replay | loss | correction | seeds | greedy_acc | abs_diff | kl |"
    assert lines[2] == "| dense | - | ppo | none | 1 | 0.1 [0.1, 0.1] | 0.4 [0.4, 0.4] | n/a |"  # grid order
    assert lines[3] == "| moe | on | bapo | token_tis | 3 | 0.3 [0.2, 0.5] | 0.2 [0.2, 0.2] | n/a |"
    with pytest.raises(ValueError, match="no trained step"):
        study.summarise([{"step": 0, "eval/greedy_acc": 0.3}], arm, 0)


def test_the_gap_figures():
    from measure import gap_stats

    stats = gap_stats([torch.tensor([0.0, 1.0]), torch.tensor([-1.0, 0.0, 0.0, 0.0])])
    assert stats["tokens"] == 6 and stats["mean_abs_log_ratio"] == pytest.approx(2 / 6)
    assert stats["token_outside"] == pytest.approx(2 / 6)  # e and 1/e lie outside [0.5, 2]
    assert stats["sequence_outside"] == 1.0 and stats["geometric_outside"] == 1.0
    assert gap_stats([])["tokens"] == 0
