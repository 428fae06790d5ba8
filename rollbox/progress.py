"""A progress line for long batches: done/total, live pass rate, throughput, time left.

Stdlib only (a bar is ~60 lines; not worth a dependency). On a terminal the line redraws in
place; elsewhere (CI logs, pipes) a line is printed every ``log_every_s`` seconds at most.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 24


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Counts finished items and redraws one line on ``stream``.

    Args:
        total: items to do.
        label: what is being done, e.g. ``"humaneval"``.
        unit: the items' name, for the throughput (``"samples"``).
        already: items done before this run started (resumed); shown, but not in the rate.
        enabled: draw at all (default: always; a terminal gets the redrawn line).
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        unit: str = "items",
        already: int = 0,
        stream: TextIO | None = None,
        enabled: bool = True,
        log_every_s: float = 10.0,
    ) -> None:
        self.total = total
        self.label = label
        self.unit = unit
        self.done = already
        self.already = already
        self.passed = 0
        self.failed = 0
        self.errors = 0
        self.skipped = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.interactive = enabled and self.stream.isatty()
        self.log_every_s = log_every_s
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._last_log = self.started
        self._logged_at = -1

    def update(self, passed: bool | None, *, skipped: bool = False) -> None:
        """One more item done: passed, failed, None for an infrastructure error, or skipped."""
        self.done += 1
        if skipped:
            self.skipped += 1
        elif passed is None:
            self.errors += 1
        elif passed:
            self.passed += 1
        else:
            self.failed += 1
        self._maybe_draw()

    @property
    def rate(self) -> float:
        """Items per second in this run."""
        elapsed = time.monotonic() - self.started
        return (self.done - self.already) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """The progress line, without drawing it."""
        fraction = self.done / self.total if self.total else 1.0
        filled = int(fraction * _WIDTH)
        bar = "#" * filled + "." * (_WIDTH - filled)
        scored = self.passed + self.failed
        rate = self.rate
        parts = [
            f"{self.label} [{bar}] {self.done}/{self.total}",
            f"pass {100 * self.passed / scored:.1f}%" if scored else "pass -",
            f"{rate:.1f} {self.unit}/s",
        ]
        if self.errors:
            parts.append(f"{self.errors} errors")
        if self.skipped:
            parts.append(f"{self.skipped} skipped")
        if rate > 0 and self.done < self.total:
            parts.append(f"eta {format_duration((self.total - self.done) / rate)}")
        return "  ".join(parts)

    def _maybe_draw(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.interactive:
            if now - self._last_draw >= 0.1 or self.done == self.total:
                self._last_draw = now
                self.stream.write("\r\033[K" + self.line())
                self.stream.flush()
        elif now - self._last_log >= self.log_every_s:
            self._last_log = now
            self._logged_at = self.done
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        """Draw the final line and end it."""
        if not self.enabled:
            return
        if self.interactive:
            self.stream.write("\r\033[K" + self.line() + "\n")
        elif self._logged_at != self.done:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
