"""`bapo-train CONFIG --rollout-only`: the engines generate and the reward scores the run's prompts
with the starting weights, nothing trains: every sample in rollouts.jsonl, each step's reward figures
in metrics.jsonl, in <run_dir>/rollout_only; no checkpoint, optimizer or trainer weights written. Its
dry run makes the run's checks: what one refuses the other refuses, with the same line."""

import contextlib
import json
import shutil

import pytest

from tests.online import MODEL, args, no_engine_left, train, write_task

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def task(tmp_path_factory, hf_model):
    return write_task(tmp_path_factory.mktemp("rollout-only"), 64, hf_model(*MODEL))


def test_rollout_only_generates_and_scores_without_training(task, tmp_path, capsys):
    from bapo_megatron.train import main

    run = tmp_path / "run"
    out = train([*args(task, run, 20), "--rollout-only", "--steps", "2"])
    assert "--rollout-only: 2 steps generated and scored; no trainer, nothing saved" in out, out[-3000:]
    assert sorted(p.name for p in run.iterdir()) == ["rollout_only"]  # a training run's records stay as they are
    own = run / "rollout_only"
    rollouts = [json.loads(line) for line in (own / "rollouts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rollouts] == [1] * 16 + [2] * 16  # every sample: 4 prompts x 4 samples a step
    assert all(0 <= r["reward"] <= 1 and r["response"] for r in rollouts)
    steps = [json.loads(line) for line in (own / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2]
    for m, step in zip(steps, (1, 2), strict=True):
        rewards = [r["reward"] for r in rollouts if r["step"] == step]
        assert m["rollout/reward_mean"] == pytest.approx(sum(rewards) / 16)
        assert m["rollout/reward_positive_share"] == sum(r > 0 for r in rewards) / 16
        assert m["rollout/reward_std"] > 0 and m["rollout/response_length_max"] <= 16
        groups: dict[str, set[float]] = {}
        for r in rollouts:
            if r["step"] == step:
                groups.setdefault(r["group"], set()).add(r["reward"])
        assert len(groups) == 4 and m["rollout/flat_share"] == sum(len(g) == 1 for g in groups.values()) / 4
        assert not [k for k in m if k.startswith(("train/", "loss/", "sync/"))], m  # nothing trained or sent
    assert json.loads((own / "status.json").read_text())["state"] == "finished"
    assert not (own / "ckpt").exists() and not (own / "engine_model").exists()
    no_engine_left(run)

    # The dry run checks what the run checks: a config the run refuses, refused alike.
    (tmp_path / "no-weights").mkdir()
    shutil.copy(task / "m" / "config.json", tmp_path / "no-weights")
    for extra, said in [
        ([], "# data (the run's own checks)"),
        ([f"rollout.replay={tmp_path}"], "error: rollout.replay="),
        ([f"model.hf_path={tmp_path / 'no-weights'}"], "--rollout-only starts the engines from a Hugging Face"),
    ]:
        with pytest.raises(SystemExit) if extra else contextlib.nullcontext():
            main([*args(task, tmp_path / "dry", 2), *extra, "--rollout-only", "--dry-run"])
        text = capsys.readouterr()
        assert said in text.out + text.err, text
    assert not (tmp_path / "dry").exists()
