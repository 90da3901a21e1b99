"""Colocated engines on every node of the trainer: the plan (engines/fleet.colocated_servers), the
servers the driver starts on its own node, and what the dry run says of them for 1, 2 and 4 nodes.
Whose copy each server loads, and servers started on each node, run in tests/dist/test_colocate_nodes.py."""

from pathlib import Path

import pytest

from bapo_megatron.cli.dry_run import _engines
from bapo_megatron.config import load_config
from bapo_megatron.engines.fleet import ColocatedServer, Engines, block_layout, colocated_servers
from bapo_megatron.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_every_node_gets_its_share_fed_by_the_ranks_on_its_gpus():
    layout = block_layout(16, 8)
    assert layout == [list(range(8)), list(range(8, 16))]
    servers = colocated_servers(4, 4, layout)
    assert servers == [
        ColocatedServer(0, 0, (0, 1, 2, 3), (0, 1, 2, 3)),
        ColocatedServer(1, 0, (4, 5, 6, 7), (4, 5, 6, 7)),
        ColocatedServer(2, 1, (0, 1, 2, 3), (8, 9, 10, 11)),
        ColocatedServer(3, 1, (4, 5, 6, 7), (12, 13, 14, 15)),
    ]
    # srun's cyclic distribution: node 0 runs ranks 0, 2; node 1 ranks 1, 3: each server is fed by its node's
    cyclic = colocated_servers(2, 2, [[0, 2], [1, 3]])
    assert [(s.node, s.ranks) for s in cyclic] == [(0, (0, 2)), (1, (1, 3))]
    # fewer servers than GPUs: the first GPUs of every node, never all on the first node
    assert [(s.node, s.gpus) for s in colocated_servers(2, 4, layout)] == [(0, (0, 1, 2, 3)), (1, (0, 1, 2, 3))]


@pytest.mark.parametrize(
    ("servers", "tp", "message"),
    [
        (3, 4, r"3 server\(s\) do not divide among 2 node\(s\); rollout.engines.servers=4 \(2 node\(s\) x 2 of TP 4\)"),
        (6, 4, r"3 server\(s\) a node x TP 4 need the GPUs of 12 trainer ranks on each node, and a node runs 8"),
        (2, 16, r"a server of TP 16 needs 16 trainer ranks on a node, and a node runs 8"),
    ],
)
def test_plans_that_do_not_fit_are_refused_naming_the_count_that_would(servers, tp, message):
    with pytest.raises(ValueError, match=message):
        colocated_servers(servers, tp, block_layout(16, 8))


def _rollout(*overrides: str):
    return load_config(None, ["rollout.engines.kind=sglang", "rollout.engines.colocate=true", *overrides]).rollout


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_dry_run_plans_the_servers_of_every_node(nodes):
    r = _rollout(f"rollout.engines.servers={2 * nodes}", "rollout.engines.tensor_parallel=4")
    text = "\n".join(_engines(r, 8 * nodes, 8, None))
    assert f"{2 * nodes} sglang server(s), TP 4 each, colocated with the trainer on every node: {nodes} node(s)" in text
    last = nodes - 1
    assert (
        f"node {last}: server {2 * last} on GPUs 0-3 (weights from trainer ranks {8 * last}-{8 * last + 3}), "
        f"server {2 * last + 1} on GPUs 4-7 (weights from trainer ranks {8 * last + 4}-{8 * last + 7})"
    ) in text
    assert ("nodes 1..2 likewise" in text) == (nodes == 4)
    assert "wait during generation" not in text


def test_the_dry_run_says_which_gpus_wait_and_what_uses_them_all():
    text = "\n".join(_engines(_rollout("rollout.engines.servers=4", "rollout.engines.tensor_parallel=4"), 32, 8, None))
    assert "4 node(s) x 1 server(s)" in text
    assert "16 of the trainer's 32 GPUs run no engine and wait during generation; rollout.engines.servers=8" in text
    refused = "\n".join(_engines(_rollout("rollout.engines.servers=2"), 32, 8, None))
    assert "cannot place them (colocated engines go on every node of the trainer: 2 server(s) do not divide" in refused


class _Stub:
    """What Engines._servers_here reads of its engines."""

    def __init__(self, *overrides: str) -> None:
        self.cfg = load_config(None, ["rollout.engines.colocate=true", *overrides])


def test_the_driver_starts_its_own_nodes_share_and_refuses_a_plan_that_does_not_fit(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert Engines._servers_here(_Stub("rollout.engines.servers=4", "rollout.engines.tensor_parallel=4"), 8) == 2
    assert Engines._servers_here(_Stub("rollout.engines.servers=4", "rollout.engines.colocate=false"), 8) == 4
    monkeypatch.setenv("WORLD_SIZE", "8")  # one node: all of them, as before
    assert Engines._servers_here(_Stub("rollout.engines.servers=2", "rollout.engines.tensor_parallel=4"), 8) == 2
    monkeypatch.setenv("WORLD_SIZE", "16")
    with pytest.raises(ConfigError, match=r"rollout.engines.servers.*3 server\(s\) do not divide among 2 node"):
        Engines._servers_here(_Stub("rollout.engines.servers=3"), 8)


def test_the_slurm_scripts_colocate_on_every_trainer_node():
    """COLOCATE=1: one server per ENGINE_TP GPUs of every trainer node, listening where the driver reaches them."""
    common = (ROOT / "slurm" / "common.sh").read_text()
    assert '"rollout.engines.servers=$((TRAIN_NODES * gpus_per_node / engine_tp))"' in common
    assert '"rollout.engines.host=0.0.0.0"' in common.split("if [[ $COLOCATE == 1 ]]", 1)[1].split("else", 1)[0]


def test_sglang_on_several_nodes_must_listen_where_the_driver_reaches_it(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    loopback = _Stub("rollout.engines.kind=sglang", "rollout.engines.servers=2")
    with pytest.raises(ConfigError, match=r"rollout.engines.host.*rollout.engines.host=0.0.0.0"):
        Engines._servers_here(loopback, 8)
    beyond = _Stub("rollout.engines.kind=sglang", "rollout.engines.servers=2", "rollout.engines.host=0.0.0.0")
    assert Engines._servers_here(beyond, 8) == 1
