"""Progress bars on stderr (tqdm): the rollout's groups and tokens/s, the update's micro-batches,
the checkpoint tools' bytes. A bar that is off costs nothing and draws nothing."""

from __future__ import annotations

import sys
import time


def bars_on(setting: bool | None) -> bool:
    """Whether bars draw, from logging.progress: as set, or (None) where stderr is a terminal (a
    log file or CI gets only the one line of metrics a step)."""
    return sys.stderr.isatty() if setting is None else setting


class Progress:
    """A bar over `total` units, or nothing when not enabled. leave=False: it clears itself when
    closed, so the per-step metrics line stays the only line a step leaves behind."""

    def __init__(
        self, total: int, desc: str, *, unit: str = "it", enabled: bool = True, leave: bool = False, **tqdm_options
    ) -> None:
        self._bar = None
        self._start = time.monotonic()
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=desc, unit=unit, leave=leave, file=sys.stderr, dynamic_ncols=True, **tqdm_options
            )

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def reach(self, done: int, note: str | None = None) -> None:
        """Move the bar to `done` units (it never goes back), with a note after it."""
        if self._bar is not None:
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)
            if note is not None:
                self._bar.set_postfix_str(note, refresh=False)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self._start

    def close(self) -> None:
        if self._bar is not None:
            self._bar.refresh()  # the final count is drawn, even within tqdm's redraw interval
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def byte_progress(total: int, desc: str, enabled: bool = True) -> Progress:
    """A bar over bytes, with bytes/s, that stays when done (the checkpoint tools' bar)."""
    return Progress(total, desc, unit="B", enabled=enabled, leave=True, unit_scale=True, unit_divisor=1024)
