"""Engine servers as subprocesses: start, wait for readiness (or fail with the log's tail), stop.

Servers always run as separate processes: a failed in-process SGLang Engine start kills its
caller, and the trainer and engine may use different Python environments.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from bapo_megatron.common.processes import die_with_parent

if TYPE_CHECKING:
    from bapo_megatron.config import RolloutConfig

LAUNCHER_ENV = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)
"""The trainer's torchrun/srun variables: an engine is no rank of the trainer's job, and torch reads them."""


def new_admin_key() -> str:
    """A fresh admin key for the engines: hex, so that it never starts with "-" (one url-safe key in 64
    did, and SGLang's argument parser read it as an option and would not start)."""
    return secrets.token_hex(32)


def checked_admin_key(key: str, source: str) -> str:
    """A key the user gave (`source` names where from), refused where an engine could not take it."""
    if len(key) < 16:
        raise ValueError(f"{source}: the key is shorter than 16 characters")
    if key.startswith("-"):
        raise ValueError(f"{source}: the key starts with '-', which SGLang's argument parser reads as an option")
    return key


class EngineStartError(RuntimeError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def answers(url: str, path: str = "/health", timeout_s: float = 2.0) -> bool:
    """Whether the server at `url` answers `path` with 200 now (no answer, an error: False)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + path, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def refuses_key(url: str, key: str, timeout_s: float = 2.0) -> bool:
    """Whether the server at `url` refuses `key` on a control endpoint (401/403): another job's
    server holds the port. A GET of a POST-only control endpoint: authentication comes first
    (SGLang's middleware, the embedded server's), so the owner answers 405 and nothing runs."""
    request = urllib.request.Request(
        url.rstrip("/") + "/update_weight_version", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return False
    except urllib.error.HTTPError as err:
        return err.code in (401, 403)
    except (urllib.error.URLError, OSError):
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """One engine server process, its URL and its log file.

    A server started on a free port (`port_file`: its command says `--port 0 --port-file FILE`)
    binds port 0 and writes the port it got to FILE: its URL is known once `wait_ready` has read
    it, and from then on its command names that port, so that a restart comes back at the same URL.
    """

    def __init__(
        self,
        command: list[str],
        url: str | None,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        port_file: str | Path | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        assert (url is None) == (port_file is not None), "a URL, or a port file to learn it from"
        self.command, self.log_path = command, Path(log_path)
        self.url = url.rstrip("/") if url is not None else None
        self.port_file, self.host = (Path(port_file) if port_file is not None else None), host
        inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV and not k.startswith("TORCHELASTIC_")}
        self.env = {**inherited, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.port_file is not None:
            self.port_file.unlink(missing_ok=True)  # (a previous start's)
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child holds it)
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=die_with_parent
        )
        log.close()
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout_s: float = 300.0, path: str = "/health", key: str | None = None) -> ServerProcess:
        """Poll until the server answers 200, the process exits, or the timeout passes (clear error).

        key: the admin key this server was started with. A server that answers but refuses it is
        another job's, on a port taken after this job checked it: never taken for this one."""
        deadline = time.monotonic() + timeout_s
        foreign = ""
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise EngineStartError(
                    f"engine server exited with code {self.process.returncode} before it was "
                    f"ready ({' '.join(self.command[:4])} ...){foreign}; log tail:\n{self.log_tail()}"
                )
            if self.url is None:
                self._read_port()
            if self.url is not None and answers(self.url, path):
                if key is None or not refuses_key(self.url, key):
                    return self
                foreign = f"; another server answers on {self.url} and refuses this job's key: the port is taken"
            if time.monotonic() > deadline:
                self.stop()
                raise EngineStartError(
                    f"engine server at {self.url or 'a free port (none reported yet)'} not ready after "
                    f"{timeout_s:.0f} s{foreign}; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def _read_port(self) -> None:
        """The port the server reports in its port file, once written: the URL, and the command
        pinned to it (a restart binds the same port)."""
        try:
            port = int(self.port_file.read_text())
        except (OSError, ValueError):  # not written yet (it is written whole: renamed into place)
            return
        self.url = f"http://{self.host}:{port}"
        self.command = [*self.command]
        at = self.command.index("--port") + 1
        self.command[at] = str(port)
        del self.command[self.command.index("--port-file") : self.command.index("--port-file") + 2]
        self.port_file.unlink(missing_ok=True)
        self.port_file = None

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """Kill at once (fault tests, a hung server)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def embedded_server(
    model_dir: str | Path,
    log_path: str | Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    seed: int = 0,
    admin_key: str | None = None,
    max_batch: int | None = None,
    batch_invariant: bool = False,
    dtype: str = "float32",
) -> ServerProcess:
    """A (not yet started) embedded engine serving model_dir in `dtype` (float32 or bfloat16); the
    admin key travels in its environment. port None: a free port, which the engine binds itself and
    reports (no other process can take it between a check and the bind)."""
    port_file = Path(f"{log_path}.port") if not port else None
    command = [
        sys.executable,
        "-m",
        "bapo_megatron.engines.embedded",
        "--model",
        str(model_dir),
        "--port",
        str(port or 0),
        "--host",
        host,
        "--seed",
        str(seed),
        "--dtype",
        dtype,
    ]
    if max_batch is not None:
        command += ["--max-batch", str(max_batch)]
    if batch_invariant:
        command.append("--batch-invariant")
    if port_file is not None:
        command += ["--port-file", str(port_file)]
    env = {"BAPO_ADMIN_API_KEY": admin_key} if admin_key else {}
    url = f"http://{host}:{port}" if port else None
    return ServerProcess(command, url, log_path, env, port_file=port_file, host=host)


def embedded_servers(
    ro: RolloutConfig,
    model_dir: str | Path,
    run_dir: Path,
    seed: int,
    admin_key: str | None,
    host: str = "127.0.0.1",
    first: int = 0,
) -> list[ServerProcess]:
    """The job's rollout.engines.servers embedded engines (not started), as the driver and bapo-serve both
    start them: engine i on port rollout.engines.port + i (unset: a free port each) with seed + i,
    logging to run_dir/engine_i.log; i from `first` (a node's colocated engines: engines/fleet.py)."""
    engines = ro.engines
    return [
        embedded_server(
            model_dir,
            run_dir / f"engine_{i}.log",
            port=None if engines.first_port is None else engines.first_port + i,
            host=host,
            seed=seed + i,
            admin_key=admin_key,
            max_batch=engines.max_batch,
            batch_invariant=ro.deterministic,
            dtype="float32" if engines.dtype == "auto" else engines.dtype,
        )
        for i in range(first, first + engines.servers)
    ]
