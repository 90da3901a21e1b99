"""The job's inference servers: started by the driver (embedded on loopback, SGLang by its launcher)
or already running elsewhere (rollout.engines.urls), as one pool of clients.

    engines = Engines(cfg, spec, run_dir, loop)      # ports free, SGLang placeable, URLs answering: checked
    engines.launch(model_dir)                        # (optional) processes started, not waited for
    engines.start(model_dir)                         # started (or connected) and ready
    loop.run(engines.check_version(7))               # every engine serves weight version 7
    engines.close()                                  # what was started, stopped

A started engine dies with this process (parent-death signal), so a killed driver leaves none
behind. Started embedded engines get a generated admin key; SGLang's key comes from its launcher.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from pathlib import Path

from bapo_megatron.common.routes import recorded_routes
from bapo_megatron.config import JobConfig
from bapo_megatron.engines.client import EngineClient, EngineError, EngineUnavailable, ServedModel
from bapo_megatron.engines.launcher import ServerProcess, embedded_servers
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
            for i in range(e.servers if e.first_port is not None else 0):  # (free ports: each engine binds its own)
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
                EngineClient(s.url, self.key, timeout_s=e.request_timeout_s, served=self.served) for s in self.servers
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
            self.key = secrets.token_urlsafe(32)
            self.servers = embedded_servers(self.cfg.rollout, model_dir, self.run_dir, self.cfg.seed, self.key)
            for server in self.servers:
                server.start()
        else:
            from bapo_megatron.engines.sglang_launcher import launch_sglang

            self.servers, self.key = launch_sglang(
                self.cfg.rollout,
                str(model_dir),
                self.run_dir,
                seed=self.cfg.seed,
                colocated_fraction=colocated_fraction,
                base_gpus=self.base_gpus,
                routed_experts=recorded_routes(self.cfg, self.spec) is not None,
            )

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
            return gpu_placement(self.cfg.rollout, local_ranks, gpus)
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
