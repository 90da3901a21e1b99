"""The online loop against what users and machines do to it. Reward code that hangs, dies, exits or
returns what is not a reward: each bad call is one failed call and the run goes on; a reward that
stops working stops the run (exit 1, one error line, status.json "failed", the last checkpoint
kept), and the same command resumes it once the reward is fixed. An engine killed mid-run is
restarted and serves again only with the trainer's current weights. Nothing of a run is left
running after it."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from tests.online import (
    MODEL,
    args,
    assert_every_group_trained_once,
    engine_pids,
    metrics,
    no_engine_left,
    no_reward_worker_left,
    reward_workers_left,
    start,
    train,
    train_holding_shm,
    wait_for,
    write_task,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FLAKY = """
import os, sys, time
def flaky(text, ids, record):
    kind = sum(ids) % 8
    if kind == 0:
        time.sleep(3600)      # a verifier that never returns
    if kind == 1:
        return float("inf")
    if kind == 2:
        sys.exit(0)
    if kind == 3:
        os._exit(1)           # the worker dies
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))

def hangs(text, ids, record):
    time.sleep(3600)

def breaks(text, ids, record):
    if os.path.exists(os.path.join(os.path.dirname(__file__), "broken")):
        sys.exit(0)           # from here on, every call
    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))
"""


@pytest.fixture(scope="module")
def task(tmp_path_factory, hf_model):
    root = write_task(tmp_path_factory.mktemp("rewards"), 64, hf_model(*MODEL))
    (root / "bad.py").write_text(FLAKY)
    return root


def test_hanging_dying_and_infinite_rewards_are_failed_calls_and_the_run_goes_on(task, tmp_path):
    run = tmp_path / "flaky"
    extra = (
        f"reward.function={task / 'bad.py'}:flaky",
        "reward.timeout_s=1",
        "reward.workers=2",
        "reward.max_failure_share=0.95",
    )
    _, held = train_holding_shm(args(task, run, 3, *extra))
    got = metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3]
    assert got[-1]["rollout/reward_errors"] > 0 and got[-1]["rollout/reward_workers_replaced"] > 0, got[-1]
    assert all(0 < m["rollout/reward_failed_share"] < 1 for m in got), got
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    no_reward_worker_left(task)
    no_engine_left(run)
    assert not [name for name in held if os.path.exists(name)], held  # nothing its processes held is left


def test_a_reward_that_stops_working_stops_the_run_and_the_same_command_resumes(task, tmp_path):
    run = tmp_path / "breaks"
    extra = (f"reward.function={task / 'bad.py'}:breaks", "checkpoint.interval=1", "reward.failure_steps=2")
    proc = start(args(task, run, 30, *extra))
    log = run / "metrics.jsonl"
    wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 2, proc, "two steps")
    (task / "broken").touch()
    out, _ = proc.communicate(timeout=600)
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert last.startswith(f"error: reward '{task / 'bad.py'}:breaks': ") and "SystemExit: 0" in last, last
    status = json.loads((run / "status.json").read_text())
    saved = int((run / "ckpt" / "latest").read_text().strip().removeprefix("step_"))
    logged = [m["step"] for m in metrics(run)]
    assert status["state"] == "failed" and "SystemExit" in status["error"], status
    assert 2 <= saved == logged[-1] == status["step"] < 30 and logged == list(range(1, saved + 1))
    no_reward_worker_left(task)

    (task / "broken").unlink()  # fixed: the same command goes on from the last good step
    train(args(task, run, saved + 1, *extra))
    assert [m["step"] for m in metrics(run)] == list(range(1, saved + 2))
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    no_engine_left(run)


def test_a_killed_engine_is_restarted_and_serves_only_the_trainers_weights(task, tmp_path):
    """The run's only engine, SIGKILLed mid-run: the driver starts it again (same port and options);
    the step waits, every rank helps send it the current weights, its version and its log-probs of
    the probe are checked (within 1e-5 of the trainer's), and only then does it serve: the run
    finishes with no group lost or trained twice."""
    run = tmp_path / "restart"
    argv = args(task, run, 5, "rollout.sync.check_every=1")
    proc = start(argv)
    log = run / "metrics.jsonl"
    wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 2 and engine_pids(run), proc, "two steps")
    ((port, pid),) = engine_pids(run).items()
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert f":{port} stopped answering (exit code -9): restarting it (attempt 1 of 3)" in out, out[-4000:]
    got = metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    refits = [m for m in got if "sync/refit_probe_gap" in m]
    assert len(refits) == 1 and refits[0]["sync/refit_probe_gap"] <= 1e-5, refits
    assert got[-1]["engine/restarts"] == 1 and got[-1]["engine/live"] == 1
    assert all(m["sync/probe_logprob_gap"] <= 1e-5 for m in got)
    assert_every_group_trained_once(run, argv, 5)
    no_engine_left(run)


def test_an_engine_that_cannot_come_back_stops_the_run_with_one_error_line(task, tmp_path):
    """The engine's model directory gone (a node that lost its disk): each restart fails at start;
    after rollout.engines.max_restarts of them the run stops, exit 1, one error line naming the
    engine and its log, status.json "failed"."""
    run = tmp_path / "no-restart"
    model = tmp_path / "model"
    shutil.copytree(task / "m", model)
    proc = start(args(task, run, 20, f"model.hf_path={model}", "rollout.engines.max_restarts=2"))
    log = run / "metrics.jsonl"
    wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 1 and engine_pids(run), proc, "a step")
    model.rename(tmp_path / "moved")
    ((port, pid),) = engine_pids(run).items()
    os.kill(pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=600)
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert last.startswith(f"error: engine http://127.0.0.1:{port} did not come back after 2 restarts"), last
    assert last.endswith(".log"), last
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and "did not come back" in status["error"], status
    no_engine_left(run)


@pytest.mark.parametrize("save_on_signal", [True, False], ids=["save", "end"])
def test_sigterm_while_every_reward_hangs_ends_the_run_and_its_workers(task, tmp_path, save_on_signal):
    """A verifier that never returns, under a long reward.timeout_s: SIGTERM (Slurm's warning before
    the time limit) is not held up by it. With checkpoint.save_on_signal the step in progress is
    given up and the run stops as signalled (exit 0, status "stopped", to be resumed); without,
    it ends at once through its teardown (exit 143). No worker and no engine are left."""
    run = tmp_path / f"hangs-{save_on_signal}"
    extra = (f"reward.function={task / 'bad.py'}:hangs", "reward.timeout_s=600")
    proc = start(args(task, run, 3, *extra, f"checkpoint.save_on_signal={str(save_on_signal).lower()}"))
    wait_for(lambda: reward_workers_left(task) and engine_pids(run), proc, "a reward call")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert not (run / "metrics.jsonl").exists() or not metrics(run), out[-3000:]
    if save_on_signal:
        assert proc.returncode == 0, out[-3000:]
        said = "signal 15 at step 0 of 3: nothing was saved; the same command starts over"
        assert out.strip().splitlines()[-1] == said
        status = json.loads((run / "status.json").read_text())
        assert status["state"] == "stopped" and status["reason"] == "signal" and status["step"] == 0, status
    else:
        assert proc.returncode == 143, out[-3000:]
        assert json.loads((run / "status.json").read_text())["state"] == "interrupted"
    no_reward_worker_left(task)
    no_engine_left(run)


def test_sigterm_while_the_engine_restarts_saves_and_stops_in_seconds(task, tmp_path):
    """Async, with held-out evaluations: the only engine killed, its restarts failing slowly (the
    model directory gone), and SIGTERM meanwhile (Slurm's warning before the time limit): the step in
    progress, its cut requests and the evaluation waiting for an engine are given up, the steps
    trained are saved, exit 0, status "stopped". Before, the run waited rollout.engines.wait_s
    (set long here) and exited 1 without saving (issue 34's F2)."""
    run = tmp_path / "restarting"
    model = tmp_path / "model"
    shutil.copytree(task / "m", model)
    (task / "heldout.jsonl").write_text((task / "prompts.jsonl").read_text().split("\n", 8)[8])
    extra = (
        f"model.hf_path={model}",
        "rollout.mode=async",
        "rollout.partial.enabled=false",
        "rollout.partial.token_budget=null",
        "rollout.max_staleness=1",
        "rollout.engines.max_restarts=1000",
        "rollout.engines.wait_s=3600",
        f"eval.path={task / 'heldout.jsonl'}",
        "eval.interval=1",
        "eval.samples=2",
    )
    proc = start(args(task, run, 50, *extra))
    log = run / "metrics.jsonl"
    wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 2 and engine_pids(run), proc, "two steps")
    model.rename(tmp_path / "moved")
    ((_, pid),) = engine_pids(run).items()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pid not in engine_pids(run).values(), proc, "the engine's death")  # no engine serves from here
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)  # seconds; the bug waited an hour here
    assert proc.returncode == 0, out[-4000:]
    status = json.loads((run / "status.json").read_text())
    trained = max(m["step"] for m in metrics(run))
    assert status["state"] == "stopped" and status["reason"] == "signal" and status["step"] == trained, status
    assert (run / "ckpt" / "latest").read_text().strip() == f"step_{trained:08d}"
    no_engine_left(run)
