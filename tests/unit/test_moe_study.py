"""examples/moe_replay_study: a run's record from its metrics, the table of medians and ranges."""

import importlib.util
import json
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "moe_replay_study" / "run.py"
_spec = importlib.util.spec_from_file_location("moe_replay_study_run", _SCRIPT)
study = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study)


def _write_run(path: Path, disagreement: list[float], acc: float) -> Path:
    rows = [{"step": 0, "eval/greedy_acc": 0.1}]
    for step, d in enumerate(disagreement, 1):
        rows.append(
            {
                "step": step,
                "policy/entropy": 1.0,
                "moe/router_disagreement": d,
                "rollout_corr/train_rollout_logprob_abs_diff": 0.02,
                "rollout_corr/train_rollout_logprob_abs_diff_same_version": 0.01,
                "policy/positive_loss_share": 0.4,
                "moe/load_max": 1.5,
            }
        )
    rows.append({"step": len(disagreement), "eval/greedy_acc": acc})
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_records_are_means_over_steps_and_the_table_gives_medians_and_ranges(tmp_path):
    records = [
        study.summarise(_write_run(tmp_path / f"off{seed}", [0.01 * (seed + 1), 0.03 * (seed + 1)], 0.5), "off", seed)
        for seed in range(3)
    ]
    assert records[0]["router_disagreement"] == pytest.approx(0.02) and records[0]["greedy_acc"] == 0.5
    assert records[0]["steps"] == 2
    records.append(study.summarise(_write_run(tmp_path / "on0", [0.0], 0.6), "on", 0))
    table = study.table(records)
    off = next(line for line in table.splitlines() if line.startswith("| off |"))
    assert "| 3 |" in off and "0.04 [0.02, 0.06]" in off  # router disagreement: median [min, max]
    assert records[0]["first_disagreement"] == pytest.approx(0.01) and records[0]["first_mismatch"] == 0.01
    assert next(line for line in table.splitlines() if line.startswith("| on |")).count("[") == 7
    with pytest.raises(SystemExit, match="no trained step"):
        study.summarise(_write_run(tmp_path / "empty", [], 0.0), "off", 9)


def test_both_arms_commands_are_configs_the_trainer_accepts(tmp_path, monkeypatch):
    """The command each arm runs (the demo's shared regime, the study's, the arm's) loads as a config."""
    import types

    from bapo_megatron.config.loader import load_config

    monkeypatch.syspath_prepend(str(_SCRIPT.parents[1]))  # examples/: the demo's study_command
    commands = []
    monkeypatch.setattr(
        study.subprocess, "run", lambda command, **_: commands.append(command) or types.SimpleNamespace(returncode=0)
    )
    warm = {"task": {"model": "m", "train": "t.jsonl", "heldout": "h.jsonl"}, "sft": tmp_path / "sft"}
    args = types.SimpleNamespace(out=tmp_path, steps=6, prompts=8, samples=8, eval_prompts=50, quiet=True)
    for arm in study.ARMS:
        study.train(args, warm, 0, arm)
    replay = []
    for command in commands:
        config_at = next(i for i, part in enumerate(command) if part.endswith("rl.yaml"))
        config = load_config(command[config_at], command[config_at + 1 :])
        assert config.rollout.mode == "async" and config.rollout.record_routes and config.algo.loss == "bapo"
        replay.append(config.algo.routing_replay)
    assert replay == [False, True]
