"""Parse an untrusted file in a child process with a time and memory limit.

PDF, DOCX and HTML parsers inflate, recurse and allocate in proportion to what a file
claims, not to its size. The ingestion worker runs each such file here: the child gets
the file's path and the limits, writes its documents as JSON lines to a result file, and is
killed when it passes ``timeout_s``; its address space is capped so a bomb that slips past
the explicit checks fails the child (a per-file error), not the worker.

    python -m services.retrieval.core.sandbox
    (reads {"path", "filename", "limits", "out", "keep_hidden_text"?} on stdin)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from services.common.errors import InvalidRequest, TandemError
from services.retrieval.core.parsing import MIB, InputDocument, ParseLimitError, ParseLimits, parse_file

# Interpreter, parsers and their working sets besides the decompressed content itself.
BASE_MEMORY = 768 * MIB
# The folder holding the ``services`` package: the child imports it whatever its cwd.
CODE_ROOT = Path(__file__).resolve().parents[3]


def _limit_memory(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def parse_isolated(
    path: Path, filename: str, limits: ParseLimits, *, keep_hidden_text: bool = False
) -> list[InputDocument]:
    """Documents of the file at ``path``, or an InvalidRequest naming the file and the problem.
    Text a reader cannot see is left out unless ``keep_hidden_text`` (``parse_file``)."""
    memory = BASE_MEMORY + 4 * limits.max_decompressed_bytes
    with tempfile.TemporaryDirectory(prefix="tandem-parse-") as tmp:
        out = Path(tmp) / "result.json"
        request = {
            "path": str(path),
            "filename": filename,
            "limits": asdict(limits),
            "out": str(out),
            "keep_hidden_text": keep_hidden_text,
        }
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "services.retrieval.core.sandbox"],
                input=json.dumps(request).encode(),
                capture_output=True,
                timeout=limits.timeout_s,
                preexec_fn=(lambda: _limit_memory(memory)) if os.name == "posix" else None,
                env={
                    **os.environ,
                    "PYTHONPATH": os.pathsep.join(
                        filter(None, [str(CODE_ROOT), os.environ.get("PYTHONPATH")])
                    ),
                },
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ParseLimitError(
                f"file {filename!r}: parsing took longer than {limits.timeout_s:g} s "
                "(limit set by TANDEM_RETRIEVAL_PARSE_TIMEOUT_S)",
                param="file",
                code="parse_limit_exceeded",
            ) from None
        if proc.returncode != 0 or not out.exists():
            tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            if "MemoryError" in tail[0] or proc.returncode < 0:
                raise ParseLimitError(
                    f"file {filename!r}: parsing needed more than {memory // MIB} MiB of memory "
                    "(limit follows TANDEM_RETRIEVAL_PARSE_MAX_DECOMPRESSED_MB)",
                    param="file",
                    code="parse_limit_exceeded",
                )
            raise InvalidRequest(f"file {filename!r}: could not be parsed ({tail[0]})", param="file")
        result = json.loads(out.read_text())
    if "error" in result:
        cls = ParseLimitError if result.get("code") == "parse_limit_exceeded" else InvalidRequest
        raise cls(result["error"], param="file", code=result.get("code"))
    return [InputDocument(**d) for d in result["documents"]]


def _child() -> None:
    request = json.loads(sys.stdin.read())
    limits = ParseLimits(**request["limits"])
    try:
        data = Path(request["path"]).read_bytes()
        keep = bool(request.get("keep_hidden_text", False))
        docs = parse_file(request["filename"], data, limits=limits, keep_hidden_text=keep)
        result: dict[str, object] = {"documents": [asdict(d) for d in docs]}
    except TandemError as exc:
        result = {"error": exc.message, "code": exc.code}
    except MemoryError:
        result = {
            "error": f"file {request['filename']!r}: parsing ran out of memory",
            "code": "parse_limit_exceeded",
        }
    Path(request["out"]).write_text(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    _child()
