"""Question sets as JSON lines: one reader for the evaluation API's uploads and for the files
`tandem eval rag` reads, so both skip and refuse the same lines with the same words."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

from services.common import jsonsafe
from services.common.errors import InvalidRequest
from services.common.jsonsafe import JsonObject


class LineError(ValueError):
    """A line that is not a JSON object; ``line`` is 1-based."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


def json_objects(lines: Iterable[str]) -> Iterator[tuple[int, JsonObject]]:
    """(line number, object) of each line; blank lines and ``#`` lines are skipped. Lines go
    through the JSON limits (depth, NaN) every request body has: an upload is a body."""
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            data = jsonsafe.loads(line, where="line")
        except json.JSONDecodeError as exc:
            raise LineError(n, f"not JSON ({exc.msg} at column {exc.colno})") from None
        except InvalidRequest as exc:
            raise LineError(n, exc.message.removeprefix("line: ")) from None
        if not isinstance(data, dict):
            raise LineError(n, f"expected a JSON object, got {type(data).__name__}")
        yield n, data
