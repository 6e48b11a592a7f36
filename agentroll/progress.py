"""Progress display for long runs: a rich bar on a terminal, structured log lines otherwise.

Invariant: updating is O(1) and never blocks the event loop; the rich refresh thread is
stopped by ``close()`` (the owner always calls it, in ``finally``).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Literal

ProgressMode = Literal["auto", "rich", "log", "off"]
logger = logging.getLogger("agentroll.progress")


class Progress:
    """Counts finished items; shows them as a bar or as periodic ``key=value`` log lines."""

    def __init__(
        self,
        description: str,
        total: int | None,
        *,
        mode: ProgressMode = "auto",
        interval: float = 5.0,
    ) -> None:
        if mode == "auto":
            mode = "rich" if sys.stderr.isatty() else "log"
        self.mode = mode
        self.description = description
        self.total = total
        self.done = 0
        self.failed = 0
        self.interval = interval
        self._start = self._last = time.monotonic()
        self._bar = None
        self._task = None
        if mode == "rich":
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("failed={task.fields[failed]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                transient=False,
                refresh_per_second=4,
            )
            self._bar.start()
            self._task = self._bar.add_task(description, total=total, failed=0)

    def advance(self, n: int = 1, *, failed: bool = False) -> None:
        """``n`` more items done (all of them failed ones with ``failed``)."""
        self.done += n
        self.failed += n if failed else 0
        if self._bar is not None:
            self._bar.update(self._task, advance=n, failed=self.failed)  # type: ignore[arg-type]
        elif self.mode == "log":
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                self._log(now)

    def _log(self, now: float) -> None:
        rate = self.done / max(now - self._start, 1e-9)
        logger.info(
            "progress what=%s done=%d total=%s failed=%d rate_per_s=%.1f",
            self.description,
            self.done,
            self.total if self.total is not None else "?",
            self.failed,
            rate,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.mode == "log" and self.done:
            self._log(time.monotonic())
