"""A run says what it does (bapo_megatron/runinfo.py): the banner from a resolved config, the end
lines with this run's paths, its own checkpoint directory by default, another run's checkpoint
refused unless asked, "already finished" for a run whose checkpoint is at its last step, and
status.json, how it ended."""

import json
from pathlib import Path

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.job import finished_before
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.plan import layout
from bapo_megatron.runinfo import RunStatus, banner, check_resume, ending, identity
from bapo_megatron.trainer.checkpoint import RUN_RECORD

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny_online.yaml")


def _cfg(*overrides: str):
    return load_config(TINY, list(overrides))


def test_a_run_checkpoints_in_its_own_directory_unless_told():
    assert _cfg().checkpoint_path == Path("runs/tiny-online/ckpt")
    assert _cfg("name=other").checkpoint_path == Path("runs/other/ckpt")  # never the other run's
    assert _cfg("run_dir=/x/r").checkpoint_path == Path("/x/r/ckpt")
    assert _cfg("checkpoint.dir=/shared/ckpt").checkpoint_path == Path("/shared/ckpt")
    assert _cfg("checkpoint.save=false").checkpoint_path is None


def test_the_banner_says_what_the_run_will_do(tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(f"run_dir={run}", "rollout.engines.port=31000", "rollout.engines.servers=2")
    text = banner(cfg, tiny_spec(), 1, None)
    lines = text.splitlines()
    assert lines[0] == "bapo-train tiny-online: 20 steps, algo.loss=bapo, 1 process, TP 1 x PP 1 x DP 1"
    assert f"run directory  {run}" in text
    assert "model          the built-in tiny model (qwen2, 4 layers, hidden 64), 180.54K parameters, fp32" in text
    assert "start          starting from random weights" in text
    assert "2 embedded engines on 127.0.0.1:31000-31001" in text and f"logs {run}/engine_*.log" in text
    assert "prompts from examples/data/tiny_prompts.jsonl" in text
    assert "metrics.jsonl" in text and "samples.jsonl" in text and "rollouts.jsonl (16 samples a step)" in text
    assert f"checkpoints    {run / 'ckpt'}, every 5 steps and at the end, the newest 2 kept" in text

    step = run / "ckpt" / "step_00000010"
    assert f"resumed from {step}, step 10 of 20" in banner(cfg, tiny_spec(), 1, step)
    plain = banner(_cfg("checkpoint.save=false", "rollout.replay=batches/"), tiny_spec(), 4, None)
    assert "nothing will be saved (checkpoint.save=false)" in plain
    assert "replayed from batches/ (no engines)" in plain and "4 processes, TP 1 x PP 1 x DP 4" in plain
    assert "samples.jsonl" not in plain


def test_the_layout_names_the_sizes_that_are_set():
    """One line for the banner and the dry run: virtual pipeline, context and expert parallel only where set."""
    parallel = load_config(None, ["parallel.tensor=4", "parallel.expert=8"]).parallel
    assert layout(parallel, 32) == "TP 4 x PP 1 x EP 8 x DP 8"
    parallel = load_config(None, ["parallel.pipeline=2", "parallel.virtual_pipeline=2"]).parallel
    assert layout(parallel, 4) == "TP 1 x PP 2 x VPP 2 x DP 2"


def test_the_end_lines_name_what_was_written_and_the_next_commands(tmp_path):
    run = tmp_path / "run"
    cfg = _cfg(f"run_dir={run}")
    text = ending(cfg, 20, run / "ckpt" / "step_00000020")
    assert text.splitlines()[0] == (
        f"finished at step 20 of 20: checkpoint {run}/ckpt/step_00000020, metrics {run}/metrics.jsonl, "
        f"rollouts {run}/rollouts.jsonl"
    )
    assert f"python tools/convert_checkpoint.py mcore-to-hf --mcore {run}/ckpt --out {run}/hf" in text
    assert f"python -m bapo_megatron.evaluate {run}/hf HELDOUT.jsonl --config {run}/config.yaml" in text
    assert f"python tools/plot_run.py {run}" in text
    assert (ROOT / "tools" / "convert_checkpoint.py").is_file() and (ROOT / "tools" / "plot_run.py").is_file()
    nothing = ending(_cfg(f"run_dir={run}", "checkpoint.save=false"), 20, None)
    assert "no checkpoint (checkpoint.save=false)" in nothing and "mcore-to-hf" not in nothing


def _step(root: Path, record: dict | None) -> Path:
    step = root / "ckpt" / "step_00000010"
    step.mkdir(parents=True)
    if record is not None:
        (step / RUN_RECORD).write_text(json.dumps(record))
    return step


def test_another_runs_checkpoint_is_refused_unless_asked(tmp_path):
    mine = _cfg()
    step = _step(tmp_path, identity(mine, tiny_spec()))
    assert check_resume(step, identity(mine, tiny_spec()), False) is None
    # what may change on resume: the layout, the step count, the optimizer, the engines
    same = _cfg("parallel.tensor=2", "steps=40", "optimizer.lr=1e-4", "rollout.engines.port=31000")
    assert check_resume(step, identity(same, tiny_spec()), False) is None

    other = identity(_cfg("name=other", "algo.loss=ppo"), tiny_spec())
    with pytest.raises(ConfigError) as refused:
        check_resume(step, other, False)
    message = str(refused.value)
    assert message.startswith(f"checkpoint.dir={str(step.parent)!r}: holds step 10 of another run")
    assert "run name 'tiny-online', this run 'other'" in message and "algo.loss='bapo', this run 'ppo'" in message
    assert f"model.mcore_path={step}" in message and "checkpoint.allow_foreign=true" in message
    data = identity(_cfg("data.path=other.jsonl"), tiny_spec())
    with pytest.raises(ConfigError, match="data.path='examples/data/tiny_prompts.jsonl', this run 'other.jsonl'"):
        check_resume(step, data, False)

    allowed = check_resume(step, other, True)
    assert allowed.startswith(f"resuming {step}, saved by another run (run name") and "allow_foreign=true" in allowed


def test_a_checkpoint_from_before_run_records_resumes_with_a_notice(tmp_path):
    mine = identity(_cfg(), tiny_spec())
    assert "does not record which run saved it" in check_resume(_step(tmp_path / "old", None), mine, False)
    # a field one version of the package has and the other not is no difference
    recorded = json.loads(json.dumps(mine))
    del recorded["config"]["algo.loss"]
    recorded["fingerprint"] = "older"
    assert check_resume(_step(tmp_path / "newer", recorded), mine, False) is None


def test_a_run_at_its_last_step_has_nothing_to_do(tmp_path):
    step = tmp_path / "ckpt" / "step_00000020"
    cfg = _cfg(f"run_dir={tmp_path}")
    assert finished_before(cfg, step).startswith("already finished at step 20: nothing to do")
    assert finished_before(_cfg(f"run_dir={tmp_path}", "steps=30"), step) is None  # more steps: it trains on
    assert finished_before(cfg, None) is None
    RunStatus.ended(5, 20, "stop_when", None, "train/step>=4").write(tmp_path)
    early = tmp_path / "ckpt" / "step_00000005"
    assert "stop_when train/step>=4 ended it" in finished_before(
        _cfg(f"run_dir={tmp_path}", "stop_when=train/step>=4"), early
    )
    assert finished_before(_cfg(f"run_dir={tmp_path}", "stop_when=train/step>=6"), early) is None


@pytest.mark.parametrize(
    ("step", "stopped_by", "signal", "written"),
    [
        (20, None, None, {"state": "finished", "reason": "steps", "step": 20, "steps": 20, "signal": None}),
        (20, "signal", 10, {"state": "finished", "reason": "steps", "step": 20, "steps": 20, "signal": 10}),
        (
            5,
            "stop_when",
            None,
            {"state": "finished", "reason": "stop_when", "step": 5, "steps": 20, "signal": None, "stop_when": "r"},
        ),
        (7, "signal", 15, {"state": "stopped", "reason": "signal", "step": 7, "steps": 20, "signal": 15}),
    ],
)
def test_status_json_says_how_the_run_ended(tmp_path, step, stopped_by, signal, written):
    """What job scripts read (slurm/common.sh: "stopped" requeues), and what a resume reads back."""
    status = RunStatus.ended(step, 20, stopped_by, signal, "r")
    status.write(tmp_path)
    assert json.loads((tmp_path / "status.json").read_text()) == written
    assert RunStatus.read(tmp_path) == status


def test_a_failed_run_says_why_and_an_unreadable_status_is_none(tmp_path):
    RunStatus.failed(3, 20, "reward 'x' failed").write(tmp_path)
    written = json.loads((tmp_path / "status.json").read_text())
    assert written == {
        "state": "failed",
        "reason": "error",
        "step": 3,
        "steps": 20,
        "signal": None,
        "error": "reward 'x' failed",
    }
    assert RunStatus.read(tmp_path / "nowhere") is None
    for text in ("{", "[1, 2]", '{"state": "finished"}'):  # cut short, not an object, fields missing
        (tmp_path / "status.json").write_text(text)
        assert RunStatus.read(tmp_path) is None
