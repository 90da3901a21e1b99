"""A real Slurm on this machine for the tests: munged, slurmctld and slurmd (Debian's slurm-wlm
and munge), private to one temporary directory (their own ports, sockets, state and pid files),
with this machine as the one real node and fake H100 nodes in a partition of their own for
`sbatch --test-only`. Everything started is stopped by PID at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurm-wlm", "munge", "shellcheck")
REQUIRED = ("sbatch", "slurmctld", "slurmd", "munged", "scontrol", "scancel", "shellcheck")


def missing_tools() -> list[str]:
    paths = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [tool for tool in REQUIRED if shutil.which(tool, path=paths) is None]


def install_packages(timeout_s: float = 600.0) -> str | None:
    """apt-get install the packages when a tool is missing; None when they are there, else why not."""
    if not missing_tools():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"Slurm tools missing ({', '.join(missing_tools())}) and no root apt-get to install {PACKAGES}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return f"{' '.join(command)} took longer than {timeout_s:.0f} s"
        if done.returncode:
            return f"{' '.join(command)} failed: {done.stderr.strip()[-300:]}"
    return None if not missing_tools() else f"still missing after install: {', '.join(missing_tools())}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tool(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


class LocalSlurm:
    """Start with `with LocalSlurm(root) as slurm:`; slurm.env has SLURM_CONF for the client tools."""

    def __init__(self, root: Path, fake_gpu_nodes: int = 8) -> None:
        self.root = Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.fake_gpu_nodes = fake_gpu_nodes
        self.pids: dict[str, int] = {}
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------------------------------

    def write_config(self) -> None:
        r = self.root
        for sub in ("state", "spool", "log", "munge"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        cpus = os.cpu_count() or 1
        memory = max(1024, (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 20) // 2)
        lines = [
            "ClusterName=bapotest",
            f"SlurmctldHost={self.node}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobRequeue=1",
            "GresTypes=gpu",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=0",  # the fake nodes have no slurmd: never time them out
            "MinJobAge=3600",
            "KillWait=10",
            f"NodeName={self.node} CPUs={cpus} RealMemory={memory} State=UNKNOWN",
            f"PartitionName=cpu Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]
        if self.fake_gpu_nodes:
            # H100 nodes that exist only for the controller: sbatch --test-only checks the 7B and 32B
            # scripts' requests (nodes, GPUs, CPUs, memory) against them; no job ever runs there
            names = f"h100-[001-{self.fake_gpu_nodes:03d}]"
            lines += [
                f"NodeName={names} NodeAddr=127.0.1.[1-{self.fake_gpu_nodes}] CPUs=128 Boards=1 SocketsPerBoard=2 "
                "CoresPerSocket=64 ThreadsPerCore=1 "
                "RealMemory=2000000 Gres=gpu:8 State=IDLE",
                f"PartitionName=h100 Nodes={names} MaxTime=INFINITE State=UP",
            ]
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text("")  # this node has no GPUs

    def start(self) -> LocalSlurm:
        self.write_config()
        r = self.root
        socket_path = r / "munge" / "munge.socket"
        self._run_daemon(
            "munged",
            [
                _tool("munged"),
                "--force",
                f"--socket={socket_path}",
                f"--pid-file={r / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'seed'}",
            ],
            r / "munged.pid",
        )
        self._run_daemon("slurmctld", [_tool("slurmctld"), "-f", str(self.conf)], r / "slurmctld.pid")
        self._run_daemon("slurmd", [_tool("slurmd"), "-f", str(self.conf), "-N", self.node], r / "slurmd.pid")
        self.wait_node_idle()
        return self

    def _run_daemon(self, name: str, command: list[str], pid_file: Path, timeout_s: float = 30.0) -> None:
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(f"{name} did not start (exit {done.returncode}): {done.stderr.strip()}")
        deadline = time.monotonic() + timeout_s
        while not pid_file.is_file() or not pid_file.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no pid file in {timeout_s:.0f} s; log: {self.log_tail(name)}")
            time.sleep(0.1)
        self.pids[name] = int(pid_file.read_text().split()[0])

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.root / "log" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else "(no log)"

    def scontrol(self, *args: str) -> str:
        done = subprocess.run([_tool("scontrol"), *args], env=self.env, capture_output=True, text=True, timeout=60)
        if done.returncode:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def wait_node_idle(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            try:
                state = self.scontrol("show", "node", self.node)
            except RuntimeError as err:
                state = str(err)
            if "State=IDLE" in state:
                return
            time.sleep(0.5)
        raise RuntimeError(f"node {self.node} not idle after {timeout_s:.0f} s: {state.strip()[:300]}")

    # ------------------------------------------------------------------------------------------

    def sbatch(self, *args: str, cwd: Path | None = None) -> tuple[int, str]:
        """(exit code, output) of sbatch --parsable ARGS."""
        done = subprocess.run(
            [_tool("sbatch"), "--parsable", *args], env=self.env, capture_output=True, text=True, cwd=cwd, timeout=120
        )
        return done.returncode, (done.stdout + done.stderr).strip()

    def job_state(self, job_id: int) -> dict[str, str]:
        """The job's fields (JobState, Restarts, ExitCode, ...), from scontrol show job."""
        text = self.scontrol("show", "job", str(job_id), "--oneliner")
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait_job(self, job_id: int, until, timeout_s: float) -> dict[str, str]:
        """Poll the job's state until until(fields) is true; RuntimeError with the state on timeout."""
        deadline = time.monotonic() + timeout_s
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job_state(job_id)
            if until(fields):
                return fields
            time.sleep(1.0)
        raise RuntimeError(f"job {job_id}: still {fields.get('JobState')} after {timeout_s:.0f} s: {fields}")

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is None:
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> LocalSlurm:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
