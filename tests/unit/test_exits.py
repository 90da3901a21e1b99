"""However a run ends, status.json says how (runinfo.Ending), and an interrupt says what it left: the
checkpoint the same command resumes from, or that nothing was saved and what the same command starts
over from. A run that starts over keeps the logs of the start before it (keep_earlier_logs)."""

import json
import os
import signal
import subprocess
import sys

import pytest

from bapo_megatron.config import load_config
from bapo_megatron.errors import ConfigError
from bapo_megatron.models.spec import tiny_spec
from bapo_megatron.runinfo import Ending, Interrupted, RunStatus, banner, keep_earlier_logs


def _cfg(tmp_path, *overrides):
    return load_config(None, [f"run_dir={tmp_path / 'run'}", "steps=20", "checkpoint.interval=5", *overrides])


def _status(cfg) -> dict:
    return json.loads((cfg.run_path / "status.json").read_text())


def _save_step(cfg, step: int) -> None:
    """A step directory as complete as the checkpoint manager tells them apart, and `latest` naming it."""
    directory = cfg.checkpoint_path / f"step_{step:08d}"
    directory.mkdir(parents=True)
    (directory / "metadata.json").write_text("{}")
    (cfg.checkpoint_path / "latest").write_text(directory.name + "\n")


def test_ctrl_c_before_the_first_checkpoint_says_nothing_was_saved(tmp_path, capsys):
    cfg = _cfg(tmp_path, f"model.hf_path={tmp_path / 'm'}")
    with pytest.raises(Interrupted) as raised, Ending(cfg) as ending:
        ending.begin()
        ending.step = 3
        raise KeyboardInterrupt
    assert raised.value.code == 130
    said = capsys.readouterr().err.strip()
    run = cfg.run_path
    assert said == (
        f"interrupted at step 3 of 20, engines stopped: nothing was saved (the first checkpoint comes at step 5); "
        f"the same command starts over from random weights, in {run} (this start's logs then kept in {run}/previous/)"
    )
    assert _status(cfg) == {
        "state": "interrupted",
        "reason": "signal",
        "step": 3,
        "steps": 20,
        "signal": 2,
        "checkpoint": None,
    }


def test_sigterm_after_a_checkpoint_says_where_the_same_command_resumes(tmp_path, capsys):
    """SIGTERM without checkpoint.save_on_signal (job.StopSignal raises Interrupted) after step 7,
    the last checkpoint at step 5; with save_on_signal off a job script sees "interrupted", not "stopped"."""
    cfg = _cfg(tmp_path, "checkpoint.save_on_signal=false", "rollout.replay=batches/")
    _save_step(cfg, 5)
    with pytest.raises(Interrupted) as raised, Ending(cfg) as ending:
        ending.begin()
        ending.step = 7
        raise Interrupted(signal.SIGTERM)
    assert raised.value.code == 143
    assert capsys.readouterr().err.strip() == (
        f"interrupted at step 7 of 20: the same command resumes from step 5 ({cfg.checkpoint_path / 'step_00000005'}); "
        f"steps 6-7 trained again, their lines cut from the logs; run directory {cfg.run_path}"
    )
    assert _status(cfg)["state"] == "interrupted" and _status(cfg)["checkpoint"] == 5
    assert RunStatus.read(cfg.run_path) == RunStatus.interrupted(7, 20, signal.SIGTERM, 5)


def test_an_error_before_the_run_begins_replaces_a_stale_status(tmp_path):
    """A requeued run that now fails its checks must not leave the last attempt's "stopped" behind
    (slurm/common.sh would requeue it again, forever); a mistyped command creates nothing."""
    cfg = _cfg(tmp_path)
    cfg.run_path.mkdir()
    RunStatus.ended(7, 20, "signal", signal.SIGUSR1, None).write(cfg.run_path)
    with pytest.raises(ConfigError), Ending(cfg):
        raise ConfigError("checkpoint.dir", "x", "holds another run's checkpoint")
    assert _status(cfg) | {"error": "?"} == {
        "state": "failed",
        "reason": "error",
        "step": 0,
        "steps": 20,
        "signal": None,
        "error": "?",
    }
    (cfg.run_path / "status.json").unlink()
    with pytest.raises(ConfigError), Ending(cfg):
        raise ConfigError("parallel.tensor", 3, "must divide the heads")
    assert sorted(cfg.run_path.iterdir()) == []


def test_a_run_that_starts_over_keeps_the_earlier_logs_and_says_where(tmp_path):
    cfg = _cfg(tmp_path)
    run = cfg.run_path
    assert keep_earlier_logs(cfg) is None  # nothing there yet
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (run / "samples.jsonl").write_text('{"step": 1, "groups": []}\n')
    RunStatus.interrupted(2, 20, signal.SIGINT, None).write(run)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"e")  # a new start's writer would hide them
    (run / "config.yaml").write_text("steps: 20\n")
    kept = keep_earlier_logs(cfg)
    assert kept == run / "previous" / "1"
    assert sorted(p.name for p in kept.iterdir()) == ["metrics.jsonl", "samples.jsonl", "status.json", "tensorboard"]
    assert (kept / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "previous"]
    assert f"earlier logs   kept in {kept} (an earlier start's: this one starts over)" in banner(
        cfg, tiny_spec(), 1, None, kept=kept
    )
    (run / "metrics.jsonl").write_text("")  # a start that logged nothing keeps nothing
    assert keep_earlier_logs(cfg) is None
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert keep_earlier_logs(cfg) == run / "previous" / "2"


def test_an_interrupt_while_the_banner_is_said_is_this_starts_to_record(tmp_path, monkeypatch):
    """A run that starts over sets the earlier start's logs aside (its status.json too) and then says
    its banner: an interrupt from then on is recorded in the run directory (it was lost when it came
    between the banner and the run's beginning: tests/e2e/test_ctrl_c.py under load)."""
    from bapo_megatron import job, train
    from tests.helpers import make_batch

    (tmp_path / "replay").mkdir()
    make_batch(0).save(tmp_path / "replay" / "step_000.safetensors")
    cfg = _cfg(
        tmp_path,
        f"rollout.replay={tmp_path / 'replay'}",
        "logging.backends=[jsonl]",
        "parallel.max_tokens_per_microbatch=64",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "checkpoint.interval=0",
    )
    earlier = RunStatus.interrupted(2, 20, signal.SIGINT, None)
    cfg.run_path.mkdir(parents=True)
    earlier.write(cfg.run_path)
    (cfg.run_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')

    def interrupted_banner(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "banner", interrupted_banner)
    with pytest.raises(Interrupted):
        train.run(cfg)
    assert _status(cfg)["state"] == "interrupted" and _status(cfg)["step"] == 0
    assert json.loads((cfg.run_path / "previous" / "1" / "status.json").read_text())["step"] == 2


PROBE = """
import importlib.abc
import sys
from bapo_megatron import train
from bapo_megatron.runinfo import Interrupted


def run(cfg):  # an interrupt that lands in a string exec, as in a dataclass built while Megatron imports
    try:
        exec("raise KeyboardInterrupt", {})
    except KeyboardInterrupt:
        if sys.argv[1] == "during":
            raise Interrupted(2) from None  # what the run's Ending raises once it has said what was left
        raise


class CtrlC(importlib.abc.MetaPathFinder):  # Ctrl-C while the trainer imports Megatron (and torch._dynamo)
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo.variables.misc":
            sys.meta_path.remove(self)
            raise KeyboardInterrupt


if sys.argv[1] == "importing":
    sys.meta_path.insert(0, CtrlC())
else:
    train.run = run
train.main(sys.argv[2:])
"""


@pytest.mark.parametrize("when", ["before", "during"])
def test_an_interrupt_inside_a_string_exec_still_exits_130(tmp_path, when):
    """`python -m bapo_megatron.train` interrupted exits 130, not by SIGINT (-2: CPython's record of a
    KeyboardInterrupt that ended a string exec; CI saw it once in tests/e2e/test_ctrl_c.py)."""
    from tests.online import ROOT

    (tmp_path / "interrupt_probe.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "interrupt_probe", when, "steps=1", f"run_dir={tmp_path / 'run'}"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-2000:]


def test_an_interrupt_while_megatron_imports_tears_down_without_importing_it_again(tmp_path):
    """Ctrl-C in the middle of Megatron's import (torch._dynamo half imported): the run says what it
    left and exits 130; its teardown destroyed no Megatron groups (there were none), where importing
    Megatron again to do so failed on the half-imported modules (exit 1, an AttributeError)."""
    from tests.helpers import make_batch
    from tests.online import ROOT

    (tmp_path / "interrupt_probe.py").write_text(PROBE)
    (tmp_path / "replay").mkdir()
    make_batch(0).save(tmp_path / "replay" / "step_000.safetensors")
    overrides = [f"rollout.replay={tmp_path / 'replay'}", "steps=2", f"run_dir={tmp_path / 'run'}"]
    overrides += ["logging.backends=[jsonl]", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "interrupt_probe", "importing", *overrides]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("interrupted at step 0 of 2: nothing was saved")
    assert json.loads((tmp_path / "run" / "status.json").read_text())["state"] == "interrupted"
