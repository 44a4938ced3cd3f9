"""Time in tests: one bounded poll for state another process or thread changes, and a clock
that moves only when a test moves it (for windows and leases that take an injectable clock)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 30.0,
    message: str = "",
    *,
    interval: float = 0.05,
    log: Path | None = None,
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that; after ``timeout``
    seconds fail the test with ``message``, the last value seen and the tail of ``log`` (a
    worker's output, say). For state that a server, worker or thread changes in its own time,
    never for waiting out a window or a lease (those take an injectable clock)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log and log.is_file() else ""
            raise AssertionError(
                f"not within {timeout:g} s: {message or predicate!r} (last: {value!r})\n{tail}"
            )
        time.sleep(interval)


class ManualClock:
    """A clock for code that waits on a condition with a timeout (``now`` / ``wait(cv, t)``):
    ``wait`` never sleeps; it jumps to the next event scheduled with ``at`` when that comes
    before the timeout (and runs it: an arrival, say), else to the timeout. A window test is
    then exact and instant, whatever the machine's load."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start
        self._events: list[tuple[float, int, Callable[[], object]]] = []
        self._order = itertools.count()

    def now(self) -> float:
        return self.t

    def at(self, t: float, event: Callable[[], object]) -> None:
        heapq.heappush(self._events, (t, next(self._order), event))

    @property
    def pending(self) -> int:
        return len(self._events)

    def wait(self, cv: threading.Condition, timeout: float) -> None:
        end = self.t + timeout
        if self._events and self._events[0][0] <= end:
            t, _, event = heapq.heappop(self._events)
            self.t = max(self.t, t)
            event()  # runs with the caller's lock held: it must take it re-entrantly
        else:
            self.t = end
