"""Helpers of the tests that run `bapo-train` online: a tiny task, the run's command line, its records."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bapo_megatron.engines.launcher import free_port
from tests.helpers import make_hf_model, process_tree, shm_files

ROOT = Path(__file__).resolve().parents[1]
STEP_TMP = re.compile(r"^\.step_\d{8}\..+\.tmp$")
VOLATILE = ("time/", "perf/", "engine/", "rollout/seconds", "rollout/tokens_per_s", "rollout/reward_wait")
"""Wall-clock measurements (phase timings, throughput, the engines' busy share): left out of comparisons."""
REWARD = "def even(text, ids, record):\n    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))\n"


MODEL = ("m", ("qwen2", 2, False))
"""The online tests' model: hf_model(*MODEL) (tests/conftest.py), built once a session."""


def write_task(root: Path, prompts: int, model: Path | None = None) -> Path:
    """Under root: a tiny Qwen2 with weights (m/: `model`, linked, or one made here), `prompts`
    token-id prompts, the reward file."""
    root.mkdir(parents=True, exist_ok=True)
    if model is None:
        make_hf_model(root, *MODEL)
    else:
        (root / "m").symlink_to(model, target_is_directory=True)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": [3 + i % 50, 7 + i % 13, 11], "answer": str(i)}) + "\n")
    (root / "reward.py").write_text(REWARD)
    return root


def engine_port() -> int:
    """A free port below the kernel's ephemeral range: one from inside it (free_port) can be handed to
    the trainer's own gloo connections between the driver's check and the engine's bind."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(max(1024, low - 12000), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


CHECKS = (
    "logging.checks.enabled=true",
    "logging.checks.max_logprob_mismatch=1e-5",
)
"""The regression gate of every run `args` makes (logging.checks, run_checks.py): step 1's KL to the
reference is 0 (with algo.kl_coef), log-probs and entropy in range, no NaN, and the tokens of each
step's own version hold the engine's log-probs to the trainer's within 1e-5 (float32 on both ends:
~1e-6 measured; the e2e asserts hold them to the same bound); `entropy_bound` adds the most entropy
the run's model can have. A test may override any of them."""


def entropy_bound(argv: list[str]) -> list[str]:
    """logging.checks.entropy_max for the model the run's argv names: ln of its vocabulary (no
    distribution over V tokens has more; the trainer leaves the padding rows out); none where the
    model has no config.json yet."""
    models = [a.split("=", 1)[1] for a in argv if a.startswith("model.hf_path=")]
    config = Path(models[-1]) / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    return [f"logging.checks.entropy_max={math.log(vocab) + 1e-6!r}"] if vocab else []


PORTS: dict[Path, list[int]] = {}
"""The engine ports each run directory was given (no_engine_left looks for those)."""


def args(task: Path, run: Path, steps: int, *extra: str) -> list[str]:
    port = engine_port()
    PORTS.setdefault(run, []).append(port)
    model = f"model.hf_path={task / 'm'}"
    return [
        model,
        f"data.path={task / 'prompts.jsonl'}",
        f"reward.function={task / 'reward.py'}:even",
        f"steps={steps}",
        "rollout.prompts_per_step=4",
        "rollout.samples_per_prompt=4",
        "rollout.sampling.max_new_tokens=16",
        "rollout.partial.enabled=true",
        "rollout.partial.token_budget=8",
        f"rollout.engines.port={port}",
        f"checkpoint.dir={run / 'ckpt'}",
        f"run_dir={run}",
        "optimizer.lr=1e-3",
        "logging.backends=[jsonl]",
        "parallel.max_tokens_per_microbatch=64",
        *CHECKS,
        *entropy_bound([model, *extra]),
        *extra,
    ]


def start(argv: list[str], launcher: list[str] | None = None) -> subprocess.Popen:
    command = (launcher or [sys.executable, "-m"]) + ["bapo_megatron.train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_interruptible,
    )
    STARTED.append(proc)
    return proc


STARTED: list[subprocess.Popen] = []
"""Every run `start` began: one a failed test left running is killed after it (tests/conftest.py)."""


def kill_leftovers() -> None:
    """Kill the runs `start` began that are still running (a test that failed waiting for one), and
    with them their engines and reward workers (they die with their parent)."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _interruptible() -> None:
    """SIGINT as a terminal's Ctrl-C: a suite started in the background (`&`, nohup) ignores it,
    and a child keeps an ignored SIGINT ignored (Python too), so the Ctrl-C test saw nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def train(argv: list[str], launcher: list[str] | None = None) -> str:
    proc = start(argv, launcher)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    return out


def train_holding_shm(argv: list[str]) -> tuple[str, set[str]]:
    """train(argv), and the /dev/shm files its processes held along the way (sampled every 0.2 s):
    what must be gone once it ended."""
    import concurrent.futures

    proc = start(argv)
    held: set[str] = set()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        output = pool.submit(proc.communicate, timeout=900)  # its pipe drained meanwhile
        while not output.done():
            held |= shm_of_run(proc)
            time.sleep(0.2)
        out, _ = output.result()
    assert proc.returncode == 0, out[-4000:]
    return out, held


def metrics(run: Path) -> list[dict]:
    """The run's metric records so far: its complete lines (a running run may be writing the last one)."""
    text = (run / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def trained_groups(run: Path) -> list[list[str]]:
    return [json.loads(line)["groups"] for line in (run / "samples.jsonl").read_text().splitlines()]


TOL = 1e-6
"""The issue's bound for deterministic runs. Batched, the engines' float32 log-probs move by ~1e-6
with the batch a request decodes in (1.3e-6 was measured on ratio_max between two identical
runs); rollout.deterministic makes the engines batch-invariant (each request alone in its
forwards), which removes that."""


def same(a: dict, b: dict, tol: float = TOL) -> list[str]:
    """The keys whose values differ beyond tol (relative, absolute near 0), timings left out."""
    keys = {k for k in a.keys() | b.keys() if not k.startswith(VOLATILE)}
    bad = []
    for k in sorted(keys):
        x, y = a.get(k), b.get(k)
        if x is None or y is None:
            if x != y:
                bad.append(k)
        elif not math.isclose(x, y, rel_tol=tol, abs_tol=tol):
            bad.append(f"{k}: {x} != {y}")
    return bad


def wait_for(condition, proc: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.01)


def no_engine_left(path: Path) -> None:
    """No embedded engine of the runs under `path` is alive (they die with their driver); engines are
    told apart by the ports those runs were given (PORTS), not by name: other runs are not this test's."""
    mine = [f"--port {port} " for run, ports in PORTS.items() if run == path or path in run.parents for port in ports]
    assert mine, f"no run under {path}"
    deadline = time.monotonic() + 30
    while True:
        ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if "engines.embedded" in line and any(m in line + " " for m in mine)]
        if not left:
            return
        assert time.monotonic() < deadline, f"engine processes still running: {left}"
        time.sleep(0.2)


def torchrun(n: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n),
        "--master-port",
        str(free_port()),
        "-m",
    ]


def assert_every_group_trained_once(run: Path, argv: list[str], steps: int) -> list[str]:
    """The run's samples log names each trained group once, and the groups trained plus those in the
    last checkpoint's buffer are exactly the prompts drawn: none lost, none trained twice. Returns
    the groups trained."""
    from megatron.core import dist_checkpointing

    from bapo_megatron.config import load_config
    from bapo_megatron.data.prompts import PromptSource

    cfg = load_config(None, argv)
    trained = [g for step in trained_groups(run) for g in step]
    assert len(trained) == len(set(trained)) == steps * cfg.rollout.prompts_per_step, trained
    common = dist_checkpointing.load_common_state_dict(str(run / "ckpt" / f"step_{steps:08d}"))["common"]
    state = common["extras"]["rollout"]
    in_buffer = [g["uid"] for g in state["buffer"]["groups"]]
    source = PromptSource(cfg.data)
    drawn = [source.next()[0] for _ in range(state["prompts"]["position"])]
    assert sorted(trained + in_buffer) == sorted(drawn)
    return trained


def engine_pids(run: Path) -> dict[int, int]:
    """The embedded engines of run `run` that are alive: port -> pid."""
    out = {}
    ps = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in ps.splitlines():
        pid, _, command = line.strip().partition(" ")
        for port in PORTS.get(run, []):
            for i in range(8):
                if "engines.embedded" in command and f"--port {port + i} " in command + " ":
                    out[port + i] = int(pid)
    return out


def reward_workers_left(path: Path) -> list[str]:
    """Reward worker processes whose reward lives under `path` (their command line names it)."""
    ps = subprocess.run(["ps", "-ww", "-eo", "stat,args"], capture_output=True, text=True).stdout
    return [
        line
        for line in ps.splitlines()
        if "rewards.workers" in line and str(path) in line and not line.lstrip().startswith("Z")
    ]


def no_reward_worker_left(path: Path) -> None:
    """No reward worker of a run whose reward lives under `path` is alive (they die with their driver)."""
    deadline = time.monotonic() + 30
    while left := reward_workers_left(path):
        assert time.monotonic() < deadline, f"reward workers still running: {left}"
        time.sleep(0.2)


def shm_of_run(proc: subprocess.Popen) -> set[str]:
    """The /dev/shm files the run's processes (the trainer and every child: reward workers,
    multiprocessing's resource tracker, engines) hold now: what a kill could leave behind."""
    return shm_files(process_tree(proc.pid))


def assert_logs_match_checkpoint(run: Path) -> int:
    """After a kill, before the resume: every step up to the newest checkpoint has exactly one metrics
    line and one samples line (lines of later steps may follow: the resume cuts them). Returns that step."""
    latest = run / "ckpt" / "latest"
    saved = int(latest.read_text().strip().removeprefix("step_")) if latest.is_file() else 0
    logged = [m["step"] for m in metrics(run) if m["step"] >= 1] if (run / "metrics.jsonl").is_file() else []
    sampled = [json.loads(line)["step"] for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s for s in logged if s <= saved] == list(range(1, saved + 1)), (saved, logged)
    assert [s for s in sampled if s <= saved] == list(range(1, saved + 1)), (saved, sampled)
    return saved
