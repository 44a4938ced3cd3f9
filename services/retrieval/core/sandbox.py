"""Parse an untrusted file in a child process with a time and memory limit.

PDF, DOCX and HTML parsers inflate, recurse and allocate in proportion to what a file
claims, not to its size; image decoders and OCR (core/ocr.py) in proportion to its pixels.
The ingestion worker runs each such file here: the child gets the file's path and the
limits, writes its documents as JSON lines to a result file, and is killed when it passes
``timeout_s``; its address space is capped so a bomb that slips past the explicit checks
fails the child (a per-file error), not the worker.

OCR takes seconds a page, so a scan of many pages would pass any whole-file limit that suits
a born-digital file. The child tells the parent, over a pipe of its own, each time OCR of a
page begins, and each such page gives the file its page limit
(``TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S``) more time: the file's own limit counts the time
outside OCR, and a child stuck inside a page is still killed.

    python -m services.retrieval.core.sandbox
    (reads {"path", "filename", "limits", "out", "keep_hidden_text"?, "ocr"?, "progress_fd"?}
    on stdin)
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequest, TandemError
from services.retrieval.core import ocr as ocr_engine
from services.retrieval.core.ocr import IMAGE_EXTENSIONS, OcrSettings
from services.retrieval.core.parsing import (
    MIB,
    InputDocument,
    NoTextError,
    ParseLimitError,
    ParseLimits,
    extension_of,
    parse_file,
)

# Interpreter, parsers and their working sets besides the decompressed content itself.
BASE_MEMORY = 768 * MIB
# ONNX Runtime, the OCR models and their working sets (detection on a 1280-pixel image, a
# batch of lines), besides a page's pixels in their few copies (``OCR_BYTES_PER_PIXEL``).
OCR_MEMORY = 1536 * MIB
OCR_BYTES_PER_PIXEL = 16
# Files that may hold pages to read by OCR: PDFs, images, and e-mail (whose attachments may be).
MAY_OCR = (".pdf", ".eml", *IMAGE_EXTENSIONS)
# The folder holding the ``services`` package: the child imports it whatever its cwd.
CODE_ROOT = Path(__file__).resolve().parents[3]


def _limit_memory(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _spawn(memory: int) -> dict[str, Any]:
    """Popen's arguments for a child that imports ``services`` and has ``memory`` bytes of
    address space."""
    return {
        "preexec_fn": (lambda: _limit_memory(memory)) if os.name == "posix" else None,
        "env": {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(CODE_ROOT), os.environ.get("PYTHONPATH")])),
        },
    }


def run_child(
    module: str, request: dict[str, object], timeout_s: float, memory: int
) -> subprocess.CompletedProcess[bytes]:
    """``python -m module`` with ``request`` as JSON on stdin, its address space capped at
    ``memory`` bytes; subprocess.TimeoutExpired after ``timeout_s``."""
    return subprocess.run(
        [sys.executable, "-m", module],
        input=json.dumps(request).encode(),
        capture_output=True,
        timeout=timeout_s,
        check=False,
        **_spawn(memory),
    )


class TooLong(Exception):
    def __init__(self, pages: int) -> None:
        self.pages = pages  # pages whose OCR had begun


def run_parser(
    request: dict[str, object],
    timeout_s: float,
    page_s: float,
    memory: int,
    module: str = "services.retrieval.core.sandbox",
) -> tuple[int, bytes]:
    """(exit status, stderr) of the parsing child ``python -m module``; ``TooLong`` once it
    passes ``timeout_s`` plus ``page_s`` for each page whose OCR it began (it writes a byte to
    ``progress_fd`` as one begins), when it is killed."""
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", module],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=(write_end,),
                **_spawn(memory),
            )
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)  # the child's copy is the only writer: its exit ends the pipe
        pages = 0
        deadline = time.monotonic() + timeout_s
        try:
            with os.fdopen(read_end, "rb", buffering=0) as progress:
                try:
                    assert proc.stdin is not None
                    with proc.stdin:
                        proc.stdin.write(json.dumps({**request, "progress_fd": write_end}).encode())
                except BrokenPipeError:
                    pass  # it died at once: its status and stderr say why
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TooLong(pages)
                    if not select.select([progress], [], [], left)[0]:
                        continue
                    begun = len(progress.read(4096))
                    if not begun:
                        break  # the pipe closed: the child is gone, or going
                    pages += begun
                    deadline += begun * page_s
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                raise TooLong(pages) from None
        finally:
            if proc.poll() is None:  # past its time, or the worker itself stopping
                proc.kill()
                proc.wait()
        err.seek(0)
        return proc.returncode, err.read()


def parse_isolated(
    path: Path,
    filename: str,
    limits: ParseLimits,
    *,
    keep_hidden_text: bool = False,
    ocr: OcrSettings | None = None,
) -> list[InputDocument]:
    """Documents of the file at ``path``, or an InvalidRequest naming the file and the problem
    (a ``NoTextError`` naming its pages without text, for a file with none). Text a reader
    cannot see is left out unless ``keep_hidden_text``; PDF pages without a text layer and
    images are read by OCR with ``ocr`` (``parse_file``)."""
    memory = BASE_MEMORY + 4 * limits.max_decompressed_bytes
    ext = extension_of(filename)
    if ocr is None and ext in IMAGE_EXTENSIONS:
        ocr = OcrSettings()  # an image is read by OCR, or not at all
    if ocr is not None and ext in MAY_OCR:
        memory += OCR_MEMORY + OCR_BYTES_PER_PIXEL * ocr.max_pixels
    page_s = ocr.page_timeout_s if ocr is not None else 0.0
    with tempfile.TemporaryDirectory(prefix="tandem-parse-") as tmp:
        out = Path(tmp) / "result.json"
        request = {
            "path": str(path),
            "filename": filename,
            "limits": asdict(limits),
            "out": str(out),
            "keep_hidden_text": keep_hidden_text,
            "ocr": asdict(ocr) if ocr is not None else None,
        }
        try:
            status, stderr = run_parser(request, limits.timeout_s, page_s, memory)
        except TooLong as exc:
            more = (
                f", and {exc.pages} x {page_s:g} s for the pages read by OCR "
                "(TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S)"
                if exc.pages
                else ""
            )
            raise ParseLimitError(
                f"file {filename!r}: parsing took longer than {limits.timeout_s:g} s "
                f"(limit set by TANDEM_RETRIEVAL_PARSE_TIMEOUT_S){more}",
                param="file",
                code="parse_limit_exceeded",
            ) from None
        if status != 0 or not out.exists():
            tail = stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            if "MemoryError" in tail[0] or status < 0:
                raise ParseLimitError(
                    f"file {filename!r}: parsing needed more than {memory // MIB} MiB of memory "
                    "(limit follows TANDEM_RETRIEVAL_PARSE_MAX_DECOMPRESSED_MB"
                    f"{' and TANDEM_RETRIEVAL_OCR_MAX_PIXELS' if page_s else ''})",
                    param="file",
                    code="parse_limit_exceeded",
                )
            raise InvalidRequest(f"file {filename!r}: could not be parsed ({tail[0]})", param="file")
        result = json.loads(out.read_text())
    if "error" in result:
        if "pages_without_text" in result:
            raise NoTextError(result["error"], result["pages_without_text"])
        cls = ParseLimitError if result.get("code") == "parse_limit_exceeded" else InvalidRequest
        raise cls(result["error"], param="file", code=result.get("code"))
    return [InputDocument(**d) for d in result["documents"]]


def _child() -> None:
    request = json.loads(sys.stdin.read())
    limits = ParseLimits(**request["limits"])
    fd = request.get("progress_fd")
    if fd is not None:

        def began(_seconds: float) -> None:
            os.write(fd, b".")

        ocr_engine.on_each_page(began)
    ocr = OcrSettings(**request["ocr"]) if request.get("ocr") else None
    try:
        data = Path(request["path"]).read_bytes()
        keep = bool(request.get("keep_hidden_text", False))
        docs = parse_file(request["filename"], data, limits=limits, keep_hidden_text=keep, ocr=ocr)
        result: dict[str, object] = {"documents": [asdict(d) for d in docs]}
    except NoTextError as exc:
        result = {"error": exc.message, "code": exc.code, "pages_without_text": exc.pages_without_text}
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
