"""Reward calls in worker processes, each call bounded in time and memory.

    workers = RewardWorkers("pkg.module:fn", workers=4, timeout_s=20, memory_mb=2048)
    scored = await workers(text, ids, record)   # Scored(value, error): error None, or why it failed
    many = await workers.score([(text, ids, record), ...])  # the same calls, a pipe round trip a worker
    workers.close()                              # every worker process gone

A reward function is the user's code: it may hang (a sympy check on a pathological answer), leak
memory, call sys.exit or os._exit, or return inf. Each of those is one failed call (value 0.0,
the error said), never the run's end: a call past `timeout_s` has its worker killed, a worker
past `memory_mb` (address space beyond what it had after importing the reward) fails the call
with MemoryError and is replaced, a worker that exits mid-call is replaced.

A worker is `python -m bapo_megatron.rewards.workers NAME MEMORY_MB FD`: plain processes,
not multiprocessing's (no semaphores in /dev/shm, no resource tracker to outlive a killed driver).
It reads calls from stdin (length-prefixed pickles from the driver, a list of calls each) and
answers one JSON line a call on FD, in order, each call bounded alone (its time counts from the
previous answer); a call that fails its worker fails alone and the calls after it go to a new
worker, so many calls in one message end as they would one by one, for a pipe round trip (a
step's 256 samples one by one cost the loop 0.1 s on two cores). Answers go to FD, not stdout, so
that the user's prints go to the job's output and the driver never unpickles what a worker
(running user code) wrote. A worker dies with the driver (PR_SET_PDEATHSIG, and a
watchdog thread on its parent's pid for the case where the signal cannot be set).
"""

from __future__ import annotations

import ast
import asyncio
import collections
import concurrent.futures
import contextlib
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from bapo_megatron.common.processes import usr1_shielded
from bapo_megatron.errors import RunStopped
from bapo_megatron.rewards.functions import REWARDS, VerlReward, load_reward, score

if TYPE_CHECKING:  # a worker process starts from this module: it must not import the config's torch
    from bapo_megatron.config.reward import RewardConfig

START_TIMEOUT_S = 120.0  # a worker's import of the reward module (math-verify pulls in sympy)


class Scored(NamedTuple):
    value: float
    error: str | None  # None: a good call


class RewardWorkers:
    """Scores samples beside generation in `workers` processes (or inline, in this process, for
    tests: then without the time and memory bounds)."""

    def __init__(
        self,
        name: str,
        workers: int = 1,
        inline: bool = False,
        timeout_s: float = 20.0,
        memory_mb: int = 4096,
        bounds: tuple[float, float] = (-1e6, 1e6),
    ) -> None:
        load_reward(name)  # an unknown name, a file that does not import, a signature of neither form: here
        self.name, self.size, self.inline = name, workers, inline
        self.timeout_s, self.memory_mb, self.bounds = timeout_s, memory_mb, bounds
        self.failures = 0  # failed calls, all time (rollout/reward_errors)
        self.replaced = 0  # workers killed or found dead and replaced (rollout/reward_workers_replaced)
        self._idle: collections.deque[_Worker] = collections.deque()
        self._all: set[_Worker] = set()
        self._free: asyncio.Semaphore | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, config: RewardConfig, name: str) -> RewardWorkers:
        """Workers scoring with `name` (the run's reward_spec), bounded as the reward section says."""
        return cls(name, config.workers, timeout_s=config.timeout_s, memory_mb=config.memory_mb, bounds=config.range)

    async def __call__(self, text: str, ids: list[int], meta: dict[str, Any]) -> Scored:
        return (await self.score([(text, ids, meta)]))[0]

    async def score(self, calls: list[tuple[str, list[int], dict[str, Any]]]) -> list[Scored]:
        """Each (text, ids, record) call's result, in order: as the calls one by one would end (each
        bounded alone, a failed one failing alone), the workers taking a share each."""
        if self.inline:
            results = [Scored(*score(self.name, text, ids, meta, self.bounds)) for text, ids, meta in calls]
        else:
            calls = [(text, list(ids), meta) for text, ids, meta in calls]
            size = -(-len(calls) // self.size)
            shares = [calls[i : i + size] for i in range(0, len(calls), size)]
            results = [r for share in await asyncio.gather(*map(self._remote, shares)) for r in share]
        self.failures += sum(r.error is not None for r in results)
        return results

    async def _remote(self, calls: list[tuple]) -> list[Scored]:
        if self._free is None:
            self._free = asyncio.Semaphore(self.size)
            self._threads = concurrent.futures.ThreadPoolExecutor(self.size, thread_name_prefix="reward")
        results: list[Scored] = []
        async with self._free:
            while len(results) < len(calls):  # a worker that failed a call leaves the rest to a new one
                worker = self._idle.popleft() if self._idle else self._start()
                loop = asyncio.get_running_loop()
                try:
                    results += await loop.run_in_executor(
                        self._threads, worker.call, calls[len(results) :], self.timeout_s
                    )
                except BaseException:  # cancelled mid-call (a run's end): the worker's state is unknown
                    self._retire(worker)
                    raise
                if worker.alive:
                    self._idle.append(worker)
                else:
                    self._retire(worker)
                    self.replaced += 1
        return results

    def _start(self) -> _Worker:
        # Started on the event loop's thread, which lives as long as the driver: the worker's
        # death signal is tied to the thread that started it.
        worker = _Worker(self.name, self.memory_mb, self.bounds)
        self._all.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        if not worker.busy:  # else its call returns now, and releases it
            worker.release()
        self._all.discard(worker)

    def state_dict(self) -> dict[str, int]:
        return {"failures": self.failures, "replaced": self.replaced}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.failures = int(state["failures"])
        self.replaced = int(state.get("replaced", 0))

    def close(self) -> None:
        for worker in list(self._all):
            self._retire(worker)
        self._idle.clear()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)
            self._threads = None
        self._free = None


class FailingRewards:
    """Stops a run whose reward does not work: it would train on zeros and report "finished". A
    step whose batch has more than `max_share` failed reward calls is a failing step; `steps` of
    them in a row, or one step with every call failed, raise RunStopped naming the reward, the
    commonest error and a record it failed on."""

    def __init__(self, name: str, max_share: float, steps: int) -> None:
        self.name, self.max_share, self.steps = name, max_share, steps
        self.streak = 0  # failing steps in a row, up to the last batch

    @classmethod
    def from_config(cls, config: RewardConfig) -> FailingRewards:
        """The check for the reward section's reward, named by its function or the field routing it."""
        name = config.function if config.by is None else f"by {config.by}"
        return cls(name, config.max_failure_share, config.failure_steps)

    def check(self, groups: list, step: int) -> dict[str, float]:
        failed = [(s, g) for g in groups for s in g.samples if s.reward_error is not None]
        calls = sum(len(g.samples) for g in groups)
        share = len(failed) / max(calls, 1)
        self.streak = self.streak + 1 if share > self.max_share else 0
        if failed and (len(failed) == calls or self.streak >= self.steps):
            errors = collections.Counter(s.reward_error for s, _ in failed)
            error, count = errors.most_common(1)[0]
            record = next(g.meta for s, g in failed if s.reward_error == error)
            why = (
                f"every one of its {calls} calls failed in step {step}"
                if len(failed) == calls
                else f"more than reward.max_failure_share={self.max_share:g} of its calls failed in "
                f"{self.streak} steps in a row ({len(failed)} of {calls} in step {step})"
            )
            raise RunStopped(
                f"reward {self.name!r}: {why}; commonest error ({count} of {len(failed)}): {error[:300]}; "
                f"for example on the record {_shown(record)}. The run would learn nothing: fix the reward "
                "and run the same command (it resumes from the last checkpoint)"
            )
        return {"rollout/reward_failed_share": share}

    def state_dict(self) -> dict[str, int]:
        return {"streak": self.streak}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.streak = int(state.get("streak", 0))


def _shown(record: Any) -> str:
    try:
        text = json.dumps(record, default=str)
    except (TypeError, ValueError):
        text = repr(record)
    return text if len(text) <= 300 else text[:300] + "..."


# -- checks before the run: what a reward reads, against the first records --------------------


def reads(name: str) -> str | None:
    """The record field built-in reward `name` scores against ("answer", text or a number;
    "answer_ids", token ids); None for a user function, whose fields only a call tells."""
    if name not in REWARDS:
        return None
    return "answer_ids" if name == "exact_ids" else "answer"


def takes_verl_call(name: str) -> bool:
    """Whether reward `name` is a function of verl's form (functions.VerlReward): it is handed the
    record's data_source and data.answer_field's value (ground_truth), which verl's records have."""
    return isinstance(load_reward(name), VerlReward)


def value_problem(name: str, record: dict[str, Any]) -> str | None:
    """Why built-in reward `name` cannot score `record`: the field it reads (`reads`) present but
    of a type it cannot read (None: it can, or the field is absent: the caller names what is)."""
    field = reads(name)
    if field is None or field not in record:
        return None
    value = record[field]
    if field == "answer_ids":
        ok = isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
        want = "a list of token ids"
    else:
        ok = isinstance(value, str | int | float) and not isinstance(value, bool)
        want = "text or a number"
    if ok:
        return None
    kind = "null" if value is None else f"{type(value).__name__} {_shown(value)[:60]}"
    return f"reward {name!r} reads record[{field!r}] as {want}; it is {kind}"


DRY_CALL_S = 10.0
"""The most a reward's check call may take before the run starts: a reward that takes longer on an
empty response (a slow verifier, a hanging one) is not a missing field, and the run's own calls
are bounded by reward.timeout_s."""


def dry_calls(name: str, records: list[dict[str, Any]], timeout_s: float, memory_mb: int) -> list[str | None]:
    """User reward `name` called once on each of `records` with an empty response, in one worker
    process bounded as the run's are (in time, at most DRY_CALL_S): for each, the field its KeyError
    names when the record has no such field (what the reward reads is not there), else None
    (another failure, a timeout included, may be the empty response's, and is the run's to count)."""
    workers = RewardWorkers(name, 1, timeout_s=min(timeout_s, DRY_CALL_S), memory_mb=memory_mb)

    async def calls() -> list[Scored]:
        return [await workers("", [], record) for record in records]

    try:
        results = asyncio.run(calls())
    finally:
        workers.close()
    missing = []
    for scored, record in zip(results, records, strict=True):
        key = _missing_key(scored.error)
        missing.append(key if key is not None and key not in record else None)
    return missing


def _missing_key(error: str | None) -> str | None:
    """The key of a call's "KeyError: 'answer'" (None for any other failure)."""
    if error is None or not error.startswith("KeyError: "):
        return None
    try:
        key = ast.literal_eval(error.removeprefix("KeyError: "))
    except (ValueError, SyntaxError):
        return None
    return key if isinstance(key, str) and key else None


class _Worker:
    """One worker process and its two pipes; `call` blocks (run it on a thread)."""

    def __init__(self, name: str, memory_mb: int, bounds: tuple[float, float]) -> None:
        read, write = os.pipe()
        command = [sys.executable, "-m", __name__, name, str(memory_mb), repr(bounds[0]), repr(bounds[1]), str(write)]
        try:
            with usr1_shielded():  # Slurm's checkpoint signal is the driver's, not the worker's
                self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(write,))
        finally:
            os.close(write)
        self.answers = read
        self.pending = b""
        self.ready = False
        self.alive = True
        self.busy = False  # a thread is in `call`: it closes the answers' pipe, not `release`
        self._lock = threading.Lock()

    def call(self, calls: list[tuple], timeout_s: float) -> list[Scored]:
        """The results of the first calls, up to and including the first that ends the worker (one that
        does not answer in time, exits, or runs out of memory is killed, `alive` False, and that call
        is a failed one): the calls after it are not made here."""
        self.busy = True
        try:
            return self._calls(calls, timeout_s)
        except OSError as err:  # the pipe closed under us: the pool is closing
            self.kill()
            return [Scored(0.0, f"the reward's worker was stopped during the call ({err})")]
        finally:
            self.busy = False
            if not self.alive:
                self.release()

    def _calls(self, calls: list[tuple], timeout_s: float) -> list[Scored]:
        request = pickle.dumps(calls, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            if not self.ready:
                self._answer(START_TIMEOUT_S)  # {"ready": ...}: the reward imported
                self.ready = True
            self.proc.stdin.write(struct.pack(">I", len(request)) + request)
            self.proc.stdin.flush()
        except (OSError, _Gone) as err:
            self.kill()
            return [Scored(0.0, f"the reward's worker did not start or died before the call ({self._exit(err)})")]
        results: list[Scored] = []
        while self.alive and len(results) < len(calls):
            results.append(self._result(timeout_s))
        return results

    def _result(self, timeout_s: float) -> Scored:
        """The next call's answer, within timeout_s."""
        try:
            answer = self._answer(timeout_s)
        except TimeoutError:
            self.kill()
            return Scored(0.0, f"timed out after {timeout_s:g} s (reward.timeout_s): its worker was replaced")
        except _Gone as err:
            self.kill()
            return Scored(0.0, f"the reward's worker exited during the call ({self._exit(err)}): it was replaced")
        value, error = answer.get("value"), answer.get("error")
        if answer.get("exit"):  # out of memory: what it allocated may still be held
            self.kill()
        if not isinstance(error, str | None) or not isinstance(value, int | float) or isinstance(value, bool):
            self.kill()
            return Scored(0.0, f"the reward's worker answered {str(answer)[:200]}")
        return Scored(float(value), error)

    def _answer(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            ready, _, _ = select.select([self.answers], [], [], left)
            if ready:
                chunk = os.read(self.answers, 1 << 16)
                if not chunk:
                    raise _Gone("no answer")
                self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        try:
            answer = json.loads(line)
        except ValueError:
            raise _Gone(f"an unreadable answer {line[:100]!r}") from None
        if not isinstance(answer, dict):
            raise _Gone(f"an unreadable answer {line[:100]!r}")
        return answer

    def _exit(self, err: BaseException) -> str:
        code = self.proc.poll()
        if code is None:
            return str(err)
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def kill(self) -> None:
        """The process gone (its pipes' ends close with it); safe from any thread, more than once."""
        self.alive = False
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def release(self) -> None:
        """Our ends of the pipes closed (a dead worker, no call in progress)."""
        with self._lock:
            if self.answers < 0:
                return
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            os.close(self.answers)
            self.answers = -1


class _Gone(Exception):
    """The worker's end of a pipe closed."""


# -- the worker process -----------------------------------------------------------------------


def _die_with_parent() -> None:
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the driver died before the signal was set
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _limit_memory(memory_mb: int) -> None:
    """Address space: what the worker has now (the interpreter and the imported reward) plus memory_mb."""
    import resource

    with open("/proc/self/statm") as f:
        now = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = now + memory_mb * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def worker_main(argv: list[str]) -> None:
    name, memory_mb, low, high, fd = argv[0], int(argv[1]), float(argv[2]), float(argv[3]), int(argv[4])
    _die_with_parent()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it kills the workers
    answers = os.fdopen(fd, "w", buffering=1)
    requests = sys.stdin.buffer
    fn = load_reward(name)
    if name == "math":  # its imports (sympy) are part of starting, not of the first call's time
        fn("", [], {"answer": "0"})
    if memory_mb > 0:
        _limit_memory(memory_mb)
    answers.write(json.dumps({"ready": True}) + "\n")
    while True:
        header = requests.read(4)
        if len(header) < 4:
            return  # the driver closed our stdin
        for text, ids, meta in pickle.loads(requests.read(struct.unpack(">I", header)[0])):
            value, error = score(name, text, ids, meta, (low, high))
            if error is not None and error.startswith("MemoryError"):  # what it allocated may still be held
                answers.write(json.dumps({"value": 0.0, "error": f"{error} (over reward.memory_mb)", "exit": True}))
                answers.write("\n")
                os._exit(0)
            answers.write(json.dumps({"value": value, "error": error}) + "\n")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
