"""A page of a TIFF original as PNG, for a browser (which shows PNG but not TIFF).

The TIFF came from a user: it is decoded in a child process with a time and memory limit, as
the parser does (core/sandbox.py), so a hostile or huge file costs a failed request, not the
service. The PNG is written beside the original and served from there afterwards.

    python -m services.retrieval.core.renditions
    (reads {"path", "page", "max_pixels", "out"} on stdin; writes the PNG or {"error"} JSON)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from services.common.errors import InvalidRequest, NotFound
from services.retrieval.core.originals import rendition_path

# A page as large as a scan at 600 dpi of A3; the child's memory follows from it.
MAX_PIXELS = 80_000_000
TIMEOUT_S = 60.0
MEMORY = 512 * 1024 * 1024 + 8 * MAX_PIXELS


def tiff_page_png(original: Path, page: int, doc_id: str) -> Path:
    """The PNG of ``page`` (1-based) of the TIFF ``original`` of ``doc_id``, made if it is not yet."""
    # Here, not at the top: the child runs this module, and needs none of the parsers.
    from services.retrieval.core.sandbox import run_child

    out = rendition_path(original, page)
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="tandem-render-", dir=original.parent) as tmp:
        made = Path(tmp) / "page.png"
        request = {"path": str(original), "page": page, "max_pixels": MAX_PIXELS, "out": str(made)}
        try:
            proc = run_child("services.retrieval.core.renditions", request, TIMEOUT_S, MEMORY)
        except subprocess.TimeoutExpired:
            raise InvalidRequest(
                f"page {page} of document {doc_id!r} took longer than {TIMEOUT_S:g} s to convert",
                param="page",
            ) from None
        if proc.returncode == 0 and made.is_file():
            os.replace(made, out)
            return out
        reason = proc.stdout.decode(errors="replace").strip()
        try:
            error = json.loads(reason)["error"]
        except (ValueError, KeyError, TypeError):
            error = (proc.stderr.decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        error = error.replace(str(original), doc_id)  # the server's paths stay on the server
        if error == "no such page":
            raise NotFound(f"document {doc_id!r} has no page {page}", param="page", code="no_page")
        raise InvalidRequest(f"page {page} of document {doc_id!r} cannot be shown: {error}", param="page")


def _child() -> None:
    from PIL import Image

    request = json.loads(sys.stdin.read())
    Image.MAX_IMAGE_PIXELS = int(request["max_pixels"])
    page = int(request["page"])
    try:
        with Image.open(request["path"]) as img:
            try:
                img.seek(page - 1)
            except EOFError:
                print(json.dumps({"error": "no such page"}))
                sys.exit(1)
            if img.width * img.height > Image.MAX_IMAGE_PIXELS:
                raise Image.DecompressionBombError(f"{img.width}x{img.height} pixels")
            frame = img.convert("L" if img.mode in ("1", "L", "I;16", "I") else "RGB")
            frame.save(request["out"], format="PNG")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        sys.exit(1)


if __name__ == "__main__":
    _child()
