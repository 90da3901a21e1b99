"""`bapo-train` end to end: a tiny Qwen2 from an HF directory with weights, embedded engines,
partial rollout, a reward function from a file, the weight sync every step, checkpoints.

- The engines serve the trainer's weights after every sync: at staleness 0 the first update's
  log-prob mismatch is within 1e-5, and so is the probe's gap (rollout.sync.check_every).
- A second run resumes from the first's checkpoint and the run's logs hold one timeline.
- Deterministic mode: a run stopped by SIGTERM and one killed by SIGKILL (while it saves, when the
  kill lands there), each resumed, give an uninterrupted run's metrics at every step, before the
  interruption (two runs agree) and after their resume point.
- The asynchronous default, killed and resumed: no prompt group is trained twice or lost
  (the groups trained, plus those still in the saved buffer, are exactly the prompts drawn).
"""

import math
import os
import signal

import pytest

from tests.online import (
    MODEL,
    STEP_TMP,
    args,
    assert_every_group_trained_once,
    assert_logs_match_checkpoint,
    engine_pids,
    metrics,
    no_engine_left,
    no_reward_worker_left,
    same,
    shm_of_run,
    start,
    torchrun,
    train,
    trained_groups,
    wait_for,
    write_task,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def task(tmp_path_factory, hf_model):
    return write_task(tmp_path_factory.mktemp("online"), 64, hf_model(*MODEL))


def test_online_run_syncs_every_step_and_resumes(task, tmp_path):
    run = tmp_path / "run"
    train(args(task, run, 3, "rollout.sync.check_every=1"))
    first = metrics(run)
    assert [m["step"] for m in first] == [1, 2, 3]
    for m in first:
        assert m["rollout/token_staleness_max"] == 0  # oversample 1: every group finishes in its step
        assert m["rollout_corr/train_rollout_logprob_abs_diff"] <= 1e-5, m  # engines hold the trainer's weights
        assert m["sync/probe_logprob_gap"] <= 1e-5
        assert m["sync/bytes"] > 0 and m["time/weight_sync"] > 0
        assert m["rollout/rounds"] >= 2  # partial rollout cut the 16-token responses at the budget of 8
        assert m["rollout/reward_errors"] == 0 and 0 < m["rollout/reward_mean"] < 1
    assert (run / "ckpt" / "latest").read_text().strip() == "step_00000003"
    assert (run / "config.yaml").is_file() and (run / "engine_0.log").is_file()
    train(args(task, run, 5, "rollout.sync.check_every=1"))
    resumed = metrics(run)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    assert resumed[:3] == first  # the first run's lines are kept as they were
    groups = [g for step in trained_groups(run) for g in step]
    assert len(groups) == 20 and len(set(groups)) == 20
    no_engine_left(run)


def test_deterministic_runs_and_their_resumptions_agree(task, tmp_path):
    # rho of group-normalised advantages sits at 0.5: a target there makes the bounds depend on the last
    # bit of every log-prob; 0.45 keeps the test about the loop, not about float summation order
    det = (
        "rollout.deterministic=true",
        "rollout.oversample=2",
        "checkpoint.interval=1",
        "checkpoint.keep_last=10",
        "algo.bapo.target_rho=0.45",
    )
    # (two uninterrupted runs agreeing is the special case of the interrupted ones below, whose
    # steps before the signal or the kill are an uninterrupted run's: one reference run is enough)
    runs = {name: tmp_path / name for name in ("a", "term", "kill")}
    train(args(task, runs["a"], 5, *det))
    reference = metrics(runs["a"])
    assert [m["step"] for m in reference] == [1, 2, 3, 4, 5]
    assert any(m["rollout/token_staleness_max"] > 0 for m in reference)  # partial samples crossed steps

    # SIGTERM during the run: it finishes the step, saves, exits 0; the same command resumes
    proc = start(args(task, runs["term"], 5, *det))
    log = runs["term"] / "metrics.jsonl"
    wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 1, proc, "the first step")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    stopped = len(metrics(runs["term"]))
    assert 1 <= stopped < 5, "the signal came after the run had ended: nothing was tested"
    assert (runs["term"] / "ckpt" / "latest").read_text().strip() == f"step_{stopped:08d}"
    train(args(task, runs["term"], 5, *det))

    # SIGKILL, while a checkpoint is being written if the poll sees one in time
    proc = start(args(task, runs["kill"], 5, *det))
    ckpt = runs["kill"] / "ckpt"
    log = runs["kill"] / "metrics.jsonl"

    def in_save_or_late() -> bool:  # a step's temporary directory (fsutil.temporary_sibling), or step 2 done
        saving = ckpt.is_dir() and any(STEP_TMP.match(p.name) for p in ckpt.iterdir())
        return saving or (log.is_file() and log.read_text().count("\n") >= 2)

    wait_for(in_save_or_late, proc, "a save")
    proc.kill()
    proc.wait()
    assert_logs_match_checkpoint(runs["kill"])
    train(args(task, runs["kill"], 5, *det))

    for name in ("term", "kill"):
        got = metrics(runs[name])
        assert [m["step"] for m in got] == [1, 2, 3, 4, 5], name
        for m, n in zip(reference, got, strict=True):
            assert not same(m, n), (name, m["step"], same(m, n))
        assert trained_groups(runs[name]) == trained_groups(runs["a"])
        rollouts = (runs[name] / "rollouts.jsonl").read_text()  # the same texts, none repeated or lost
        assert rollouts == (runs["a"] / "rollouts.jsonl").read_text() and rollouts.count("\n") == 5 * 16, name
    no_engine_left(tmp_path)


def test_sync_partial_run_killed_and_resumed_loses_and_repeats_no_sample(task, tmp_path):
    run = tmp_path / "partial"
    argv = args(task, run, 6, "rollout.oversample=2", "checkpoint.interval=2")
    proc = start(argv)
    wait_for(lambda: (run / "metrics.jsonl").is_file() and len(metrics(run)) >= 3, proc, "the third step")
    held = shm_of_run(proc)
    proc.kill()
    proc.wait()
    assert assert_logs_match_checkpoint(run) >= 2
    no_reward_worker_left(task)  # nothing of the killed run is left: no worker, nothing it held in /dev/shm
    assert not [name for name in held if os.path.exists(name)], held
    train(args(task, run, 6, "rollout.oversample=2", "checkpoint.interval=2"))
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert_every_group_trained_once(run, argv, 6)


ASYNC = (
    "rollout.mode=async",
    "rollout.partial.enabled=false",
    "rollout.partial.token_budget=null",
    "rollout.max_staleness=1",
    "rollout.oversample=2",
)


def test_async_run_keeps_its_bound_evaluates_beside_training_and_survives_sigterm_and_sigkill(task, tmp_path):
    """rollout.mode async: every step's tokens are at most max_staleness versions older than the policy
    that trains them; held-out evaluations, run beside the next step, land in the line of the step
    they measured, at that step's version; a SIGTERM (saved at the step boundary, exit 0) and a
    SIGKILL at any moment, each resumed with the same command, lose no group and train none twice."""
    run = tmp_path / "async"
    (task / "heldout.jsonl").write_text((task / "prompts.jsonl").read_text().split("\n", 8)[8])
    extra = (
        *ASYNC,
        "checkpoint.interval=2",
        f"eval.path={task / 'heldout.jsonl'}",
        "eval.interval=2",
        "eval.samples=2",
        f"eval.sets={{small: {{path: {task / 'heldout.jsonl'}, samples: 1, max_prompts: 3}}}}",
    )
    argv = args(task, run, 7, *extra)
    proc = start(argv)
    log = run / "metrics.jsonl"
    # two trained steps (an evaluation's line of step 0 is not one)
    wait_for(lambda: log.is_file() and sum("loss/pg" in m for m in metrics(run)) >= 2, proc, "the second step")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    stopped = max(m["step"] for m in metrics(run))
    assert 2 <= stopped < 7 and (run / "ckpt" / "latest").read_text().strip() == f"step_{stopped:08d}"
    proc = start(args(task, run, 7, *extra))
    wait_for(lambda: max(m["step"] for m in metrics(run)) >= stopped + 2, proc, "two more steps")
    proc.kill()  # wherever it is: generating, training, syncing, saving
    proc.wait()
    assert assert_logs_match_checkpoint(run) >= stopped
    train(args(task, run, 7, *extra))
    got = metrics(run)
    steps = [m["step"] for m in got if "loss/pg" in m]
    assert steps == [1, 2, 3, 4, 5, 6, 7], steps
    for m in got:
        if "loss/pg" in m:
            assert m["rollout/token_staleness_max"] <= 1, m  # the bound, every step
            assert abs(sum(v for k, v in m.items() if k.startswith("rollout/staleness_share/")) - 1) < 1e-9
        if "eval/greedy_acc" in m:
            assert m["eval/version"] == m["step"], m  # measured at the version of its step
            assert m["eval/small/prompts"] == 3 and {"eval/small/avg@1", "eval/small/pass@1"} <= m.keys()
            assert m["eval/prompts"] > 3 and "eval/avg@2" in m  # the unnamed set keeps its own figures
    assert sorted(m["step"] for m in got if "eval/greedy_acc" in m) == [0, 2, 4, 6, 7]
    assert sorted(m["step"] for m in got if "eval/small/greedy_acc" in m) == [0, 2, 4, 6, 7]
    assert any(m["rollout/token_staleness_max"] == 1 for m in got if "loss/pg" in m)  # it did run ahead
    assert_every_group_trained_once(run, argv, 7)
    no_engine_left(run)


def test_async_run_at_tp2_pp2_serves_the_trainers_weights_and_outlives_an_engine(task, tmp_path):
    """Async under torchrun at TP=2 x PP=2 with two engines: after every weight update (requests in
    flight, paused in retract mode) the probe's log-probs equal the trainer's within 1e-5; one
    engine killed mid-run: its requests go to the other, the weights go to the one left (and to the
    killed one once restarted, checked by the probe before it serves), no group is lost or trained
    twice."""
    run = tmp_path / "async-tp2-pp2"
    extra = (
        *ASYNC,
        "rollout.engines.servers=2",
        "rollout.sync.check_every=1",
        "parallel.tensor=2",
        "parallel.pipeline=2",
    )
    argv = args(task, run, 5, *extra)
    proc = start(argv, launcher=torchrun(4))
    log = run / "metrics.jsonl"
    wait_for(lambda: log.is_file() and len(metrics(run)) >= 2 and len(engine_pids(run)) == 2, proc, "two steps")
    port = max(engine_pids(run))
    os.kill(engine_pids(run)[port], signal.SIGKILL)  # the second engine, mid-run
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert f":{port} stopped answering" in out  # (restarted: it serves again after a refit, if in time)
    got = metrics(run)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    for m in got:
        assert m["sync/probe_logprob_gap"] <= 1e-5 and m.get("sync/refit_probe_gap", 0) <= 1e-5, m
        assert m["rollout/token_staleness_max"] <= 1, m
    assert got[-1]["rollout/engine_failures"] >= 1
    refits = [m["step"] for m in got if "sync/refit_probe_gap" in m]  # the restarted engine probed back in
    assert ("has the current weights: it serves again" in out) == bool(refits), out[-4000:]
    # a refit in the last step's publish counts too (engine/live was counted before it came back: a
    # loaded machine's late restart left 1 where 2 served)
    assert got[-1]["engine/live"] == 1 + bool(refits), (refits, got[-1])
    assert_every_group_trained_once(run, argv, 5)
    no_engine_left(run)


DETERMINISTIC = ("rollout.deterministic=true", "rollout.sync.check_every=1", "algo.bapo.target_rho=0.45")


@pytest.fixture(scope="module")
def one_process(task, tmp_path_factory):
    """A deterministic 2-step run in one process: the reference every parallel layout is held to."""
    run = tmp_path_factory.mktemp("one-process") / "one"
    train(args(task, run, 2, *DETERMINISTIC))
    return run


@pytest.mark.parametrize(
    ("world", "layout"),
    [(4, ("parallel.tensor=2", "parallel.pipeline=2")), (2, ())],
    ids=["tp2-pp2", "dp2"],
)
def test_parallel_trainers_sync_their_engines_and_match_one_process(task, tmp_path, one_process, world, layout):
    """Under torchrun: the engine's log-probs after every sync equal the trainer's (the probe, and
    the first update's mismatch), and from the same HF weights the first step's loss, gradient norm
    and clip bounds equal one process's (deterministic rollout: the same samples)."""
    single, parallel = one_process, tmp_path / "many"
    train(args(task, parallel, 2, *DETERMINISTIC, *layout), launcher=torchrun(world))
    ours, theirs = metrics(parallel), metrics(single)
    assert [m["step"] for m in ours] == [1, 2]
    for m in ours:
        assert m["sync/probe_logprob_gap"] <= 1e-5 and m["rollout_corr/train_rollout_logprob_abs_diff"] <= 1e-5, m
    keys = ("loss/pg", "train/grad_norm", "bapo/clip_low", "bapo/clip_high", "bapo/rho", "rollout/reward_mean")
    for key in keys:
        assert math.isclose(ours[0][key], theirs[0][key], rel_tol=1e-5, abs_tol=1e-6), (
            key,
            ours[0][key],
            theirs[0][key],
        )
    assert trained_groups(parallel) == trained_groups(single)
    no_engine_left(tmp_path)


def test_a_failed_sync_check_stops_the_run_and_ctrl_c_leaves_nothing_running(task, tmp_path):
    """The probe's bound (here below float32's reach) stops the run with one error line, exit 1; an
    interrupt (SIGINT, as Ctrl-C sends) during a run stops its engines and exits 130."""
    run = tmp_path / "strict"
    proc = start(args(task, run, 3, "rollout.sync.check_every=1", "rollout.sync.check_max_gap=1e-12"))
    out, _ = proc.communicate(timeout=600)
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert last.startswith("error: weight sync check: ") and "rollout.sync.check_max_gap=1e-12" in last, last
    no_engine_left(run)

    run = tmp_path / "interrupted"
    proc = start(args(task, run, 50))
    log = run / "metrics.jsonl"
    wait_for(lambda: log.is_file() and log.read_text().count("\n") >= 1, proc, "the first step")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 130, out[-3000:]
    assert "engines stopped: nothing was saved" in out.strip().splitlines()[-1], out[-3000:]
    no_engine_left(run)


@pytest.mark.parametrize("world", [1, 2], ids=["one-engine", "dp2-two-engines"])
def test_colocated_engines_take_the_weights_by_handle_between_releases(task, tmp_path, world):
    """rollout.engines.colocate: the engines give their memory back after each rollout, take the weights back
    by shared-memory handle (update_weights_from_tensor, as colocated SGLang takes CUDA IPC handles)
    and serve exactly the trainer's weights after every sync. With two trainer ranks and two
    engines, engine g loads rank g's copy (weights/sync.HandleHolders; whose copy is checked in
    tests/dist/test_handle_holders.py): both serve the trainer's weights (the first update's
    mismatch covers the samples of both)."""
    run = tmp_path / "colocated"
    extra = ("rollout.engines.colocate=true", "rollout.sync.check_every=1", f"rollout.engines.servers={world}")
    train(args(task, run, 2, *extra), launcher=torchrun(world) if world > 1 else None)
    got = metrics(run)
    assert [m["step"] for m in got] == [1, 2]
    for m in got:
        assert m["sync/probe_logprob_gap"] <= 1e-5 and m["rollout_corr/train_rollout_logprob_abs_diff"] <= 1e-5, m
    # (each sync resumed the engine's memory: an engine refuses to resume memory it did not release,
    # so the run's success shows the release after each rollout happened)
    no_engine_left(run)
