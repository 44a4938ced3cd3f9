"""Reading server-sent events in tests: the named events of a stream, as (name, data) pairs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def named_events(lines: Iterable[str], *, until: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """``event: <name>`` / ``data: <json>`` pairs (an unnamed event is ``message``); stops after
    an event named in ``until`` (a stream that ends with its last event needs none)."""
    events: list[tuple[str, Any]] = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name or "message", json.loads(line[6:])))
            if name in until:
                break
    return events
