"""The job's inference servers: started by the driver (embedded on loopback, SGLang by its launcher)
or already running elsewhere (rollout.engines.urls), as one pool of clients.

    engines = Engines(cfg, spec, run_dir, loop)      # ports free, SGLang placeable, URLs answering: checked
    engines.launch(model_dir)                        # (optional) processes started, not waited for
    engines.start(model_dir)                         # started (or connected) and ready
    loop.run(engines.check_version(7))               # every engine serves weight version 7
    engines.close()                                  # what was started, stopped

A started engine dies with this process (parent-death signal), so a killed driver leaves none
behind. Started embedded engines get a generated admin key; SGLang's key comes from its launcher.

Colocated engines go on every node of the trainer (`colocated_servers`): rollout.engines.servers
divided evenly among the nodes, each server on the GPUs of TP consecutive local ranks of its node,
its engine TP rank g loading the weights from the trainer rank on its GPU (weights/sync.HandleHolders).
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, replace
from pathlib import Path

from bapo_megatron.common.routes import recorded_routes
from bapo_megatron.config import JobConfig
from bapo_megatron.engines.client import EngineClient, EngineError, EngineUnavailable, ServedModel
from bapo_megatron.engines.launcher import ServerProcess, embedded_servers, new_admin_key
from bapo_megatron.engines.loop import EngineLoop
from bapo_megatron.engines.pool import EnginePool
from bapo_megatron.errors import ConfigError, RunStopped
from bapo_megatron.models.spec import ModelSpec


def check_port(host: str, port: int, field: str) -> None:
    """ConfigError when (host, port) cannot be listened on (in use, or not this machine's)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as err:
            raise ConfigError(field, port, f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def spec_difference(spec: ModelSpec, other: ModelSpec) -> str | None:
    """The first shape field in which two specs differ, as text (None: same shape)."""
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
        if getattr(spec, name) != getattr(other, name):
            return f"{name} {getattr(other, name)} (the trainer's is {getattr(spec, name)})"
    return None


@dataclass(frozen=True)
class ColocatedServer:
    """One colocated engine: its index (place in the pool, port offset), its node (in the order of
    the nodes' first ranks: node 0 is the driver's), the local GPUs it runs on, and the global
    trainer rank on each of them (by engine TP rank), whose copy of each bucket that rank loads."""

    index: int
    node: int
    gpus: tuple[int, ...]
    ranks: tuple[int, ...]


def block_layout(world_size: int, ranks_per_node: int) -> list[list[int]]:
    """The global ranks of each node, by local rank, as torchrun and srun's block distribution place them."""
    nodes = max(1, -(-world_size // ranks_per_node))
    return [list(range(m * ranks_per_node, min(world_size, (m + 1) * ranks_per_node))) for m in range(nodes)]


def colocated_servers(servers: int, tp: int, ranks_by_node: list[list[int]]) -> list[ColocatedServer]:
    """Where `servers` colocated engines of TP `tp` run, with ranks_by_node[m][l] the global rank of
    local rank l (GPU l) on node m: servers / nodes of them on each node, server k of a node on its
    GPUs [k x TP, (k + 1) x TP). ValueError naming the counts (and the count that would use every
    GPU) when they do not divide evenly or do not fit on a node's ranks."""
    nodes = len(ranks_by_node)
    fewest = min(len(ranks) for ranks in ranks_by_node)
    if tp > fewest:
        raise ValueError(
            f"colocated, a server of TP {tp} needs {tp} trainer ranks on a node, and a node runs {fewest}: "
            "use a smaller rollout.engines.tensor_parallel, or engines on GPUs of their own"
        )
    fits = nodes * (fewest // tp)
    every = f"rollout.engines.servers={fits} ({nodes} node(s) x {fewest // tp} of TP {tp}) uses every GPU"
    if servers % nodes:
        raise ValueError(
            f"colocated engines go on every node of the trainer: {servers} server(s) do not divide among "
            f"{nodes} node(s); {every}"
        )
    per_node = servers // nodes
    if per_node * tp > fewest:
        raise ValueError(
            f"colocated, {per_node} server(s) a node x TP {tp} need the GPUs of {per_node * tp} trainer ranks on "
            f"each node, and a node runs {fewest}: {every}"
        )
    out = []
    for m, ranks in enumerate(ranks_by_node):
        for k in range(per_node):
            gpus = tuple(range(k * tp, (k + 1) * tp))
            out.append(ColocatedServer(m * per_node + k, m, gpus, tuple(ranks[g] for g in gpus)))
    return out


class Engines:
    def __init__(self, cfg: JobConfig, spec: ModelSpec, run_dir: Path, loop: EngineLoop, local_ranks: int = 1) -> None:
        """Everything that can be checked before any engine starts: the ports of the engines to
        start, SGLang's placement on this node (beside `local_ranks` trainer ranks), engines of
        another job answering with this shape."""
        self.cfg, self.spec, self.run_dir, self.loop = cfg, spec, Path(run_dir), loop
        self.served = ServedModel.of(spec, recorded_routes(cfg, spec))  # what /generate answers are checked against
        e = cfg.rollout.engines
        self.servers: list[ServerProcess] = []
        self.clients: list[EngineClient] = []
        self.pool: EnginePool | None = None
        self.key: str | None = None
        self.launched = False
        self.here = self._servers_here(local_ranks)  # the servers started on this node
        self.remote: list[str] = []  # colocated: the URLs of the other nodes' servers (node_engines)
        self.base_gpus = self._sglang_placement(local_ranks) if e.kind == "sglang" and not e.urls else None
        if e.urls:  # engines of another job: they answer and serve this shape, or nothing starts
            from bapo_megatron.engines.sglang_launcher import KEY_ENV, admin_key

            given = e.admin_key_file or os.environ.get(KEY_ENV)
            self.key = admin_key(cfg.rollout, self.run_dir) if given else None  # theirs: never one generated here
            self.clients = [
                EngineClient(url, self.key, timeout_s=e.request_timeout_s, served=self.served) for url in e.urls
            ]
            self.loop.run(self._check_answering())
        else:
            host = "127.0.0.1" if e.kind == "embedded" else e.host
            for i in range(self.here if e.first_port is not None else 0):  # (free ports: each engine binds its own)
                check_port(host, e.first_port + i, "rollout.engines.port")

    def start(self, model_dir: str | Path, colocated_fraction: float | None = None) -> EnginePool:
        """Start the engines on `model_dir` (or take rollout.engines.urls) and wait until every one
        answers; colocated_fraction: what a colocated SGLang server may take of its GPU."""
        if not self.launched:
            self.launch(model_dir, colocated_fraction)
        e = self.cfg.rollout.engines
        if e.kind == "sglang" and not e.urls:
            from bapo_megatron.engines.sglang_launcher import wait_sglang

            wait_sglang(self.servers, self.key, e.startup_timeout_s)
        else:
            for server in self.servers:
                server.wait_ready(e.startup_timeout_s, key=self.key)
        if not e.urls:
            self.clients = [
                EngineClient(url, self.key, timeout_s=e.request_timeout_s, served=self.served)
                for url in [s.url for s in self.servers] + self.remote
            ]
            if e.first_port is None:  # the banner could only say "a free port": here is which
                print(f"engines ready: {', '.join(s.url for s in self.servers)}", flush=True)
        self.pool = EnginePool(self.clients, wait_s=e.wait_s)
        return self.pool

    def launch(self, model_dir: str | Path, colocated_fraction: float | None = None) -> None:
        """Start the engine processes without waiting for them (`start` waits): a run launches them
        before it builds its trainer when their model directory is known by then, so that the two
        start-ups overlap. Nothing to launch for rollout.engines.urls."""
        e = self.cfg.rollout.engines
        self.launched = True
        if e.urls:
            return
        if e.kind == "embedded":
            self.key = new_admin_key()
            self.servers = embedded_servers(self._rollout_here(), model_dir, self.run_dir, self.cfg.seed, self.key)
            for server in self.servers:
                server.start()
        else:
            from bapo_megatron.engines.sglang_launcher import Launch, ServedLoRA, launch_sglang

            launch = Launch(
                str(model_dir),
                seed=self.cfg.seed,
                colocated_fraction=colocated_fraction,
                routed_experts=recorded_routes(self.cfg, self.spec) is not None,
                lora=ServedLoRA.of(self.spec, self.cfg.model.lora),
            )
            self.servers, self.key = launch_sglang(self._rollout_here(), launch, self.run_dir, self.base_gpus)

    def _servers_here(self, local_ranks: int) -> int:
        """The servers the driver starts on its node: all of them, or colocated, its node's share
        (colocated_servers on the launcher's nodes: WORLD_SIZE ranks, `local_ranks` a node); a
        ConfigError before any model is built when they do not divide among the nodes or fit."""
        e = self.cfg.rollout.engines
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if not e.colocate or e.urls or world <= local_ranks:
            return e.servers
        layout = block_layout(world, local_ranks)
        try:
            colocated_servers(e.servers, e.tensor_parallel, layout)
        except ValueError as err:
            raise ConfigError("rollout.engines.servers", e.servers, str(err)) from None
        from bapo_megatron.engines.launcher import is_loopback

        if e.kind == "sglang" and is_loopback(e.host):  # (embedded: the nodes of one machine, in tests)
            raise ConfigError(
                "rollout.engines.host",
                e.host,
                f"colocated on {len(layout)} nodes, the driver reaches the other nodes' servers beyond loopback: "
                "rollout.engines.host=0.0.0.0 (with an admin key, as the Slurm scripts set them)",
            )
        return e.servers // len(layout)

    def _rollout_here(self):
        """rollout config of the servers started on this node (rollout.engines.servers: theirs)."""
        ro = self.cfg.rollout
        return replace(ro, engines=replace(ro.engines, servers=self.here))

    def _sglang_placement(self, local_ranks: int) -> list[int]:
        """SGLang servers to start here: SGLang installed, GPUs on this node, and each server's
        first GPU beside the trainer's ranks here (sglang_launcher.gpu_placement); else a
        ConfigError, before any model is built."""
        import torch

        from bapo_megatron.engines.sglang_launcher import check_installed, gpu_placement

        e = self.cfg.rollout.engines
        try:
            check_installed()
        except ValueError as err:
            raise ConfigError("rollout.engines.kind", e.kind, str(err)) from None
        gpus = torch.cuda.device_count()
        if not gpus:
            raise ConfigError(
                "rollout.engines.kind",
                e.kind,
                "SGLang runs on CUDA GPUs and this machine has none (embedded runs on CPU)",
            )
        try:
            return gpu_placement(self._rollout_here(), local_ranks, gpus)
        except ValueError as err:
            raise ConfigError("rollout.engines.servers", e.servers, str(err)) from None

    async def _check_answering(self) -> None:
        """Engines that are already running answer, and serve a model of the trainer's shape."""
        for client in self.clients:
            try:
                async with EngineClient(client.base_url, self.key, timeout_s=30, retries=1) as quick:
                    info = await quick.model_info()
            except (EngineUnavailable, EngineError) as err:
                raise ConfigError("rollout.engines.urls", client.base_url, f"does not answer: {err}") from None
            served = Path(str(info.get("model_path", "")))
            if (served / "config.json").is_file():
                problem = spec_difference(self.spec, ModelSpec.from_hf_dir(served))
                if problem:
                    raise ConfigError(
                        "rollout.engines.urls", client.base_url, f"serves {served}, whose shape differs: {problem}"
                    )

    async def check_version(self, version: int, engines: list[int]) -> list[int]:
        """Each of these engines reports weight version `version` (after a sync), else RunStopped;
        returns those that did not answer (dead since: they get the weights when they come back)."""
        gone = []
        for index in engines:
            client = self.clients[index]
            try:
                served = (await client.model_info()).get("weight_version")
            except EngineUnavailable:
                gone.append(index)
                continue
            if str(served) != str(version):
                raise RunStopped(
                    f"weight sync: {client.base_url} reports weight version {served!r} after the sync of "
                    f"version {version}: its weights are not the trainer's"
                )
        return gone

    def close(self) -> None:
        """Close the clients and stop what was started here; safe to call more than once."""
        if not self.loop.closed:
            for client in self.clients:
                with contextlib.suppress(Exception):  # one that fails to close must not keep the rest open
                    self.loop.run(client.close(), timeout=30)
        for server in self.servers:
            server.stop()
        self.servers = []


def node_engines(cfg: JobConfig, spec: ModelSpec, holders, engines: Engines | None, model_dir, fraction) -> list:
    """(A collective: every rank, with its weights/sync.HandleHolders or None.) Colocated engines on
    several nodes: the driver's node's are the driver's (`engines`, rank 0's); each other node's
    local rank 0 starts its node's on rank 0's model directory, admin key and memory fraction, and
    waits until they answer; rank 0's `engines.remote` gets their URLs, in engine order. Returns the
    servers this rank started (it stops them at its close). Engines on one node: nothing to do."""
    servers = holders.servers if holders is not None else []
    if len({s.node for s in servers}) < 2:
        return []
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    shared: list = [None] * 5
    if rank == 0:
        if not engines.launched:
            engines.launch(model_dir, fraction)
        shared = [str(model_dir), engines.key, fraction, socket.gethostname(), engines.here]
    dist.broadcast_object_list(shared, src=0, device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    here, planned = shared.pop(), sum(s.node == 0 for s in servers)
    if here != planned:  # the driver counted the nodes from its launcher's environment, before any process group
        raise RunStopped(
            f"colocated engines: the driver started {here} server(s) on its node, the nodes' ranks plan {planned} "
            "there: start the same number of trainer ranks on every node"
        )
    node = next((s.node for s in servers if s.node and s.gpus[0] == 0 and s.ranks[0] == rank), None)
    started: list[ServerProcess] = []
    answer: list | str = []
    if node is not None:
        mine = [s for s in servers if s.node == node]
        try:
            started = _start_node(cfg, spec, mine, *shared)
            answer = [(s.index, _reachable(p.url, shared[3])) for s, p in zip(mine, started, strict=True)]
        except Exception as err:  # every rank stops with the reason, none waits for this node
            answer = f"colocated engines on node {node} ({socket.gethostname()}): {str(err)[:500]}"
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, answer)
    failed = [g for g in gathered if isinstance(g, str)]
    if failed:
        for server in started:
            server.stop()
        raise RunStopped(failed[0])
    if rank == 0:
        engines.remote = [url for _, url in sorted(pair for got in gathered for pair in got)]
    return started


def _start_node(cfg: JobConfig, spec: ModelSpec, mine: list[ColocatedServer], model_dir, key, fraction, driver_host):
    """This node's colocated servers (`mine`), started and answering; the driver on `driver_host`
    reaches them beyond loopback only."""
    from bapo_megatron.engines.launcher import is_loopback

    ro, e = cfg.rollout, cfg.rollout.engines
    if socket.gethostname() != driver_host and is_loopback(e.host):
        raise ValueError(
            f"rollout.engines.host={e.host}: the driver on {driver_host} cannot reach engines here; listen beyond "
            "loopback (rollout.engines.host=0.0.0.0, with an admin key)"
        )
    here = replace(ro, engines=replace(e, servers=len(mine)))
    first = mine[0].index
    if e.kind == "embedded":
        servers = embedded_servers(here, model_dir, cfg.run_path, cfg.seed, key, host=e.host, first=first)
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(e.startup_timeout_s, key=key)
        return servers
    from bapo_megatron.engines.sglang_launcher import KEY_ENV, Launch, ServedLoRA, sglang_servers, wait_sglang

    if key is not None:
        os.environ[KEY_ENV] = key  # the driver's key, never one generated here
    routes = recorded_routes(cfg, spec) is not None
    lora = ServedLoRA.of(spec, cfg.model.lora)
    launch = Launch(str(model_dir), "0", cfg.seed, fraction, routed_experts=routes, lora=lora)
    servers, _ = sglang_servers(here, launch, cfg.run_path, [s.gpus[0] for s in mine], first)
    try:
        for server in servers:
            server.start()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    wait_sglang(servers, key, e.startup_timeout_s)
    return servers


def _reachable(url: str, driver_host: str) -> str:
    """A server's URL as the driver reaches it: loopback on the driver's host, else this host's name."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if socket.gethostname() == driver_host or parts.hostname not in ("127.0.0.1", "0.0.0.0", "::", "localhost"):
        return url
    return f"{parts.scheme}://{socket.getfqdn()}:{parts.port}"
