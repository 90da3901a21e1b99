"""Reward calls in worker processes: each call bounded in time and memory, a worker that hangs,
leaks, exits or dies replaced, a value that is not a finite reward in range a failed call; the
pool goes on serving after each, and leaves no process behind."""

from __future__ import annotations

import asyncio
import os

import pytest

from bapo_megatron.errors import RunStopped
from bapo_megatron.rewards.workers import FailingRewards, RewardWorkers
from bapo_megatron.rollout.buffer import GroupState, SampleState
from tests.helpers import HOSTILE_REWARDS, shm_files


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "hostile.py"
    path.write_text(HOSTILE_REWARDS)
    return path


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "name, error",
    [
        ("hang", "timed out after 1 s"),
        ("leak", "MemoryError"),
        ("exits", "SystemExit"),
        ("dies", "exited during the call (exit code 3)"),
        ("infinite", "returned inf, outside reward.range"),
        ("huge", "returned 1e+308, outside reward.range"),
        ("nothing", "TypeError"),
        ("text_out", "ValueError"),
        ("raises", "ZeroDivisionError"),
    ],
)
def test_a_bad_call_fails_alone_and_the_pool_serves_on(rewards_file, name, error):
    bad = RewardWorkers(f"{rewards_file}:{name}", workers=1, timeout_s=1.0, memory_mb=100)

    async def calls():
        results = [await bad("x", [1, 2], {}) for _ in range(3 if name == "leak" else 2)]
        return results, [w.proc.pid for w in bad._all]

    try:
        results, pids = asyncio.run(calls())
    finally:
        bad.close()
    # each call is answered; the leak's second call is over the limit, the third has a fresh worker
    good = [True, False, True] if name == "leak" else [False] * len(results)
    assert [r.error is None for r in results] == good, results
    assert all(error in r.error and r.value == 0.0 for r in results if r.error is not None), results
    assert bad.failures >= 1
    replaced = {"hang", "leak", "dies"}
    assert (bad.replaced >= 1) == (name in replaced), (name, bad.replaced)
    assert not any(alive(pid) for pid in pids)


def test_a_function_that_cannot_take_the_call_is_refused_before_any_worker(rewards_file):
    """fn(text) takes neither fn(text, ids, record) nor verl's keyword call: refused when the pool
    is made (before the first step), not a failed call in every sample."""
    with pytest.raises(ValueError, match=r"hostile.py:arity' is called as .* its signature \(text\) takes neither"):
        RewardWorkers(f"{rewards_file}:arity")


def test_good_calls_after_a_replaced_worker_and_nothing_left(rewards_file, tmp_path):
    """A worker killed for its time is replaced; the next calls are answered by the new one; close
    leaves no worker and nothing its workers held in /dev/shm."""
    workers = RewardWorkers(f"{rewards_file}:slow_once", workers=2, timeout_s=1.0)
    flag = str(tmp_path / "flag")

    async def calls():
        results = await asyncio.gather(*(workers("x", [1], {"flag": flag}) for _ in range(6)))
        pids = [w.proc.pid for w in workers._all]
        return results, pids, shm_files(pids)

    try:
        results, pids, held = asyncio.run(calls())
    finally:
        workers.close()
    errors = [r.error for r in results if r.error is not None]
    assert len(errors) == 1 and "timed out" in errors[0], results
    assert sorted(r.value for r in results) == [0.0] + [1.0] * 5
    assert workers.replaced == 1 and workers.failures == 1
    assert pids and not any(alive(pid) for pid in pids)
    assert not [name for name in held if os.path.exists(name)], held


BY_RECORD = """
import os, sys, time
def by_record(text, ids, record):
    if record["do"] == "hang":
        time.sleep(3600)
    if record["do"] == "dies":
        os._exit(3)
    if record["do"] == "exits":
        sys.exit(0)
    return float(len(ids))
"""


def test_calls_sent_together_end_as_they_would_one_by_one(tmp_path):
    """Many calls in one message to one worker: a call that hangs or kills its worker fails alone, the
    calls after it go to a new worker, and every call ends as it does sent alone."""
    path = tmp_path / "by_record.py"
    path.write_text(BY_RECORD)
    plan = ["good", "dies", "good", "hang", "good", "exits", "good"]
    calls = [("x", [1] * (i + 1), {"do": do}) for i, do in enumerate(plan)]

    def run(together: bool):
        workers = RewardWorkers(f"{path}:by_record", workers=1, timeout_s=1.0)

        async def scored():
            return await workers.score(calls) if together else [await workers(*call) for call in calls]

        try:
            return asyncio.run(scored()), workers.replaced, workers.failures
        finally:
            workers.close()

    results, replaced, failures = run(together=True)
    assert [r.value for r in results] == [1.0, 0.0, 3.0, 0.0, 5.0, 0.0, 7.0], results
    assert "exited during the call (exit code 3)" in results[1].error and "timed out" in results[3].error
    assert "SystemExit" in results[5].error
    assert (replaced, failures) == (2, 3)
    alone = run(together=False)
    assert [r.value for r in alone[0]] == [r.value for r in results] and alone[1:] == (replaced, failures)


def _groups(errors: list[list[str | None]]) -> list[GroupState]:
    groups = []
    for g, row in enumerate(errors):
        samples = [SampleState(f"g{g}/{i}", [1], reward=0.0, reward_error=e) for i, e in enumerate(row)]
        groups.append(GroupState(f"g{g}", [1], {"answer": g}, samples))
    return groups


def test_a_reward_that_never_works_stops_the_run():
    rule = FailingRewards("my.py:fn", max_share=0.5, steps=2)
    ok = rule.check(_groups([[None, "KeyError: 'x'"], [None, None]]), step=1)
    assert ok == {"rollout/reward_failed_share": 0.25} and rule.streak == 0
    rule.check(_groups([["KeyError: 'x'"] * 2, [None, "KeyError: 'x'"]]), step=2)
    assert rule.streak == 1
    with pytest.raises(RunStopped, match=r"in 2 steps in a row \(3 of 4 in step 3\); commonest error \(3 of 3\)"):
        rule.check(_groups([["KeyError: 'x'"] * 2, [None, "KeyError: 'x'"]]), step=3)
    fresh = FailingRewards("my.py:fn", max_share=0.5, steps=5)
    with pytest.raises(RunStopped, match=r"every one of its 4 calls failed in step 7.*TypeError.*\{\"answer\": 0\}"):
        fresh.check(_groups([["TypeError: bad"] * 2, ["TypeError: bad", "ValueError: v"]]), step=7)


def test_the_reward_section_goes_straight_to_the_workers_and_the_stop_rule():
    from bapo_megatron.config import RewardConfig

    config = RewardConfig(workers=3, timeout_s=5, memory_mb=0, range=(-2, 2), max_failure_share=0.2, failure_steps=4)
    w = RewardWorkers.from_config(config, "exact")
    assert (w.name, w.size, w.timeout_s, w.memory_mb, w.bounds) == ("exact", 3, 5, 0, (-2, 2))
    rule = FailingRewards.from_config(config)
    assert (rule.name, rule.max_share, rule.steps) == ("math", 0.2, 4)
    routed = FailingRewards.from_config(RewardConfig(by="data_source", table={"aime": "math"}))
    assert routed.name == "by data_source"


def test_shm_files_sees_a_semaphore_a_child_holds():
    """The leak checks above look at what their own processes hold in /dev/shm: a named semaphore
    (mapped under glibc's deleted temporary name) is found by its inode, and only that process's."""
    import subprocess
    import sys

    code = (
        "import multiprocessing as mp, time; lock = mp.get_context('spawn').Lock(); "
        "print(lock._semlock.name, flush=True); time.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        assert shm_files([child.pid]) == {f"/dev/shm/sem.{name.lstrip('/')}"}
        assert f"/dev/shm/sem.{name.lstrip('/')}" not in shm_files([os.getpid()])
    finally:
        child.kill()
        child.wait()
