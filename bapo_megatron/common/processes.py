"""Child processes that die with the process that started them, and signals they must not take."""

from __future__ import annotations

import contextlib
import signal


def die_with_parent() -> None:
    """In a child (before exec, or as a worker pool's initializer): SIGTERM it when the process that
    started it dies (Linux), so that a killed driver leaves no engine or worker behind. SIGUSR1 is
    ignored: it asks the driver to checkpoint, and Slurm sends it to every process of a job step."""
    import ctypes

    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # kept across exec
    with contextlib.suppress(OSError):  # not Linux: the driver's own teardown is all there is
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def usr1_shielded():
    """SIGUSR1 blocked in this thread meanwhile (held pending, delivered after). Children started
    inside inherit the blocked mask: multiprocessing's spawned workers and its resource tracker,
    which set no disposition of their own for it, then outlive the checkpoint signal that Slurm
    sends to every process of a job step (one killed tracker or worker breaks the reward pool)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
