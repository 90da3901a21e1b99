"""Colocated engines on every node of the trainer, on one machine: the nodes are told apart by their
node rank (GROUP_RANK, as torchrun --nnodes sets it).

- (the handoff alone, whose copy each engine of each node loads with the nodes' ranks in blocks
  or cyclic: tests/dist/test_handle_holders.py, in its launch)
- a run of two torchrun "nodes" (--nnodes=2, one CPU process each) with colocated embedded
  engines: each node's rank starts its node's engine (seen by process parentage), and both serve
  every sync's weights (the version check after every sync, the probe's log-probs against the
  trainer's).

What only a GPU cluster checks: SGLang servers on each node's GPUs (base GPU, memory fraction),
CUDA IPC handles opened by them, and the driver reaching them beyond loopback."""

import subprocess
import sys

import pytest


@pytest.mark.e2e
@pytest.mark.slow
def test_two_nodes_each_start_their_engine_and_feed_it_the_weights(tmp_path, hf_model):
    from bapo_megatron.engines.launcher import free_port
    from tests.online import MODEL, args, engine_pids, metrics, no_engine_left, start, wait_for, write_task

    task = write_task(tmp_path / "task", 16, hf_model(*MODEL))
    run = tmp_path / "run"
    colocated = ("rollout.engines.colocate=true", "rollout.engines.servers=2", "rollout.sync.check_every=1")
    argv = args(task, run, 1, *colocated)
    port = free_port("127.0.0.1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1"]
    rendezvous = ["--master-addr=127.0.0.1", f"--master-port={port}"]
    launchers = [[*torchrun, f"--node-rank={node}", *rendezvous, "-m"] for node in (0, 1)]
    procs = [start(argv, launcher) for launcher in launchers]
    wait_for(lambda: len(engine_pids(run)) == 2, procs[0], "both engines")
    engines = sorted(engine_pids(run).items())  # by port: engine 0, engine 1
    for (_, pid), proc in zip(engines, procs, strict=True):
        trainer = _parent(pid)
        assert _parent(trainer) == proc.pid, (pid, trainer, proc.pid)  # node m's rank started node m's engine
    outs = [proc.communicate(timeout=900)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    got = metrics(run)
    assert [m["step"] for m in got] == [1]
    for m in got:  # both engines served every version (checked after each sync) and the trainer's weights
        assert m["sync/probe_logprob_gap"] <= 1e-5 and m["rollout_corr/train_rollout_logprob_abs_diff"] <= 1e-5, m
    no_engine_left(run)


def _parent(pid: int) -> int:
    status = subprocess.run(["ps", "-o", "ppid=", "-p", str(pid)], capture_output=True, text=True).stdout
    return int(status.strip())
