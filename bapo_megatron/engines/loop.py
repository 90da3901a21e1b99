"""The engines' event loop, on a thread of its own, so that requests go on while the caller trains.

    loop = EngineLoop()
    result = loop.run(coro)            # blocks until done; Ctrl-C cancels it, then raises KeyboardInterrupt
    future = loop.submit(coro)         # a concurrent.futures.Future; loop.wait(future) as run() waits
    with loop.context(acm): ...        # an async context manager around a block of this thread
    loop.close()                       # cancels what still runs, stops the thread

Everything that touches the rollout's state (the buffer, the requests in flight) runs on this
loop, so nothing else needs a lock. The caller's thread keeps what must stay on it: torch's
collectives and the trainer's CUDA device.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class EngineLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        unwound = threading.Event()

        async def guarded():
            try:
                return await coro
            finally:
                unwound.set()

        future = asyncio.run_coroutine_threadsafe(guarded(), self.loop)
        future.unwound = unwound  # set once the coroutine has finished, however it ended
        return future

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        return self.wait(self.submit(coro), timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the loop's thread (where the rollout's state changes), waited for."""

        async def on_loop() -> Any:
            return fn(*args)

        return self.run(on_loop())

    def wait(self, future: concurrent.futures.Future, timeout: float | None = None) -> Any:
        """The future's result. Interrupted (Ctrl-C), it is cancelled and waited for, so that every
        request it made unwinds at an await, never mid-call; then KeyboardInterrupt is raised."""
        try:
            return future.result(timeout)
        except KeyboardInterrupt:
            future.cancel()
            future.unwound.wait(60)
            raise

    @contextlib.contextmanager
    def context(self, manager: contextlib.AbstractAsyncContextManager):
        """An async context manager entered and left on the loop, around this thread's block."""
        result = self.run(manager.__aenter__())
        try:
            yield result
        except BaseException as err:
            if not self.run(manager.__aexit__(type(err), err, err.__traceback__)):
                raise
        else:
            self.run(manager.__aexit__(None, None, None))

    @property
    def closed(self) -> bool:
        return self.loop.is_closed()

    def cancel_all(self, timeout_s: float = 60.0) -> None:
        """Cancel every task on the loop (requests still in flight after an interrupt) and wait for
        them to unwind."""
        if self.loop.is_closed() or not self._thread.is_alive():
            return

        async def cancel() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self.submit(cancel()).result(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Cancel every task still on the loop, wait for them to unwind, stop the thread."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.cancel_all(timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
