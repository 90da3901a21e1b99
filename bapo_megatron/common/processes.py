"""Child processes that die with the process that started them, and signals they must not take."""

from __future__ import annotations

import contextlib
import os
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


_forking_parent: int | None = None  # the pid of the process that forks, recorded just before it does
_guarded = False


def forked_children_die_with_this_process() -> None:
    """From now on every child this process forks (multiprocessing's fork context: Megatron's
    checkpoint writers, FileSystemWriterAsync.write_preloaded_data_multiproc) gets SIGKILL when its
    parent dies (Linux), so that a trainer killed mid-save leaves no writer holding a copy of its
    memory; a child whose parent died before the signal was set exits at once. Idempotent.

    The signal belongs to the thread that forked: Megatron's synchronous save forks from the
    thread that saves, the trainer's main thread, which lives as long as the trainer."""
    global _guarded
    if _guarded:
        return

    def before() -> None:
        global _forking_parent
        _forking_parent = os.getpid()

    def in_child() -> None:
        import ctypes

        with contextlib.suppress(OSError, AttributeError):  # not Linux: nothing to set
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if _forking_parent is not None and os.getppid() != _forking_parent:
            os._exit(1)  # the parent died between the fork and the signal

    os.register_at_fork(before=before, after_in_child=in_child)
    _guarded = True
