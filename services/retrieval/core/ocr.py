"""Text of page images by OCR: PDF pages without a text layer (``ocr_pdf_pages``, called by
``parsing.pdf_document``) and PNG, JPEG and TIFF files (``ocr_image``, core/image_files.py).

The engine is RapidOCR (``rapidocr_onnxruntime``): PaddleOCR's PP-OCRv4 text detection and
recognition models and its line-angle classifier, run by ONNX Runtime. The models ship inside
the wheel: nothing is downloaded. One engine per process, loaded on first use; the ingestion
worker parses in a child process per file (core/sandbox.py), so it loads once per file.

A page is read in four steps:

1. It becomes an image: a PDF page rendered by pypdfium2 at ``OcrSettings.dpi``; a frame of an
   image file decoded by Pillow (a TIFF's frames are pages; a JPEG turned as its EXIF says).
2. Detection finds the text lines on a copy at most ``DETECT_SIDE`` pixels a side (a smaller
   image enlarged, ``DETECT_UPSCALE`` times at most): finding a line needs less resolution than
   reading it, and detection at full resolution costs three times as much and reads no better
   (measured in docs/retrieval.md, "Scans and images").
3. Each line is cut from the full-resolution image, given a margin in its background's colour
   (``CROP_MARGIN``) and recognised, ``REC_BATCH`` lines at a time; all the lines of a page are
   turned over first when the angle classifier finds most of them upside down (a page scanned
   upside down).
4. The lines are put in reading order: rows top to bottom, the pieces of one row left to right
   joined into one line; a band of the page set in columns is read column by column
   (``pdf_layout``'s gutter finder, the one born-digital PDF pages use).

Boxes are ``(x0, top, x1, bottom)`` from the page's top-left corner: PDF points for PDF pages,
pixels for images.

Limits, besides those of the sandbox around the whole file (its time, its memory):

* Pixels: a PDF page is rendered at ``dpi`` unless that gives more than ``max_pixels``; then at
  the resolution that gives ``max_pixels`` (downscaled, not refused: the renderer makes only
  the pixels it is asked for, and a poster-sized page still has text worth reading). An image
  frame of more than ``max_pixels`` is refused, that page failing with the reason: its pixels
  are in the file, and decoding them is the cost the limit bounds. Pillow's own
  decompression-bomb guard stays on beneath it.
* Time: each page has ``page_timeout_s``. The clock is checked after the page is decoded, after
  detection and after each batch of recognised lines; a page past its limit becomes an
  ``OcrPage`` with ``error`` naming the limit (not a failed file). A page overruns its limit by
  one step at most: detection of an image at most ``DETECT_SIDE`` pixels a side, or one batch.
  The sandbox's parent gives a file one page limit more for each page OCR begins
  (``on_each_page``), so that the whole-file limit counts the time outside OCR, and stays a
  hard limit (the child is killed) for a page that hangs.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequest

# The languages the installed recognition model reads: RapidOCR ships PP-OCRv4's Chinese model,
# whose alphabet is Chinese characters, Latin letters, digits and punctuation (a few accented
# letters only: é, è, à, ü, ä). Other languages need other models, which are not installed.
LANGUAGES = {"en": "English", "zh": "Chinese (simplified), and English"}
# Image files read by OCR, a page each (a TIFF: a page a frame).
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
# A 600 dpi scan of an A4 page is 35 million pixels; a 24-megapixel photo, 24.
DEFAULT_MAX_PIXELS = 40_000_000

# Longest side, in pixels, of the image detection runs on (see the module docstring, step 2);
# a smaller image is enlarged towards it, ``DETECT_UPSCALE`` times at most, so that small text
# is tall enough to find.
DETECT_SIDE = 1280
DETECT_UPSCALE = 2.0
# Margin added around a cut-out line, in line heights: detection's boxes hug the letters, and
# the recogniser, cramped, drops the spaces between words.
CROP_MARGIN = 0.2
# How sure the classifier must be that a line is upside down to count it so.
FLIP_SCORE = 0.9
# Lines recognised between two looks at the clock (RapidOCR's own batch size).
REC_BATCH = 6
# Recognitions less sure than this are noise (RapidOCR's default ``text_score``).
MIN_SCORE = 0.5
# Smaller than this a side, an image holds no line of text to read.
MIN_SIDE = 8
IMAGE_FORMATS = ("PNG", "JPEG", "TIFF")  # JPEG includes MPO, the JPEG of many phone cameras


@dataclass(frozen=True)
class OcrLine:
    text: str
    box: tuple[float, float, float, float]  # x0, top, x1, bottom in page units


@dataclass(frozen=True)
class OcrPage:
    page: int  # 1-based
    width: float
    height: float
    lines: list[OcrLine]  # reading order
    error: str = ""  # why this page has no text (e.g. "OCR passed its 60 s limit")


@dataclass(frozen=True)
class OcrSettings:
    """How pages are read: ``language`` is the collection's ``ocr_language``; the limits are the
    settings TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S, _MAX_PIXELS and _DPI."""

    language: str = "en"
    page_timeout_s: float = 60.0
    max_pixels: int = DEFAULT_MAX_PIXELS  # per page
    dpi: int = 200


def check_language(value: str) -> str:
    """``value`` if the installed models read it, else a 400 naming it and the choices."""
    if value not in LANGUAGES:
        choices = ", ".join(f"{k!r} ({v})" for k, v in LANGUAGES.items())
        raise InvalidRequest(
            f"ocr_language {value!r} is not a language the installed OCR models read; choices: {choices}",
            param="ocr_language",
            code="unsupported_ocr_language",
        )
    return value


# --- the engine -----------------------------------------------------------------------------------

_lock = threading.Lock()
_engines: dict[str, Any] = {}


def _engine() -> Any:
    """The process's RapidOCR engine (every language reads with the one shipped model)."""
    with _lock:
        if "rapidocr" not in _engines:
            from rapidocr_onnxruntime import RapidOCR

            # A few threads at most: ONNX Runtime's default of one per core of the host would
            # crowd out the other workers, and every thread reserves address space under the
            # sandbox's memory limit.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = max(1, min(4, cores))
            # Detection takes the image at the size ``_read`` gives it (RapidOCR's default enlarges
            # a strip of text until its short side is 736 pixels: 4416 x 736 for a 480 x 80 one).
            _engines["rapidocr"] = RapidOCR(
                intra_op_num_threads=threads, inter_op_num_threads=1, det_limit_type="max"
            )
        return _engines["rapidocr"]


# Called as OCR of each page begins, with that page's time limit (core/sandbox.py).
PageHook = Callable[[float], None]
_page_hook: list[PageHook] = []


def on_each_page(hook: PageHook | None) -> None:
    """Call ``hook(page_timeout_s)`` as OCR of each page begins (None: stop)."""
    _page_hook[:] = [hook] if hook is not None else []


class _PastLimit(Exception):
    pass


class _Budget:
    def __init__(self, seconds: float, clock: Callable[[], float]) -> None:
        self.seconds, self.clock = seconds, clock
        self.end = clock() + seconds
        for hook in _page_hook:
            hook(seconds)

    def check(self) -> None:
        if self.clock() > self.end:
            raise _PastLimit

    def reason(self) -> str:
        return f"OCR passed its {self.seconds:g} s limit (TANDEM_RETRIEVAL_OCR_PAGE_TIMEOUT_S)"


# --- one page image -------------------------------------------------------------------------------


class _Found:
    """A recognised piece of a line, in image pixels (what ``pdf_layout``'s row and column
    finders read: ``x0``, ``top``, ``x1``, ``bottom``)."""

    __slots__ = ("bottom", "text", "top", "x0", "x1")

    def __init__(self, text: str, x0: float, top: float, x1: float, bottom: float) -> None:
        self.text, self.x0, self.top, self.x1, self.bottom = text, x0, top, x1, bottom


def _letterbox(img: Any) -> tuple[Any, int]:
    """A short strip of text with white margins above and below, and their height: detection
    needs room around a line (RapidOCR's own letterbox, in white rather than black)."""
    import cv2

    h, w = img.shape[:2]
    if h > 30 and w / h <= 8:
        return img, 0
    pad = max((max(w // 8, 30) * 2 - h) // 2, 0)
    white = (255, 255, 255)
    return cv2.copyMakeBorder(img, pad, pad, 0, 0, cv2.BORDER_CONSTANT, value=white), pad


def _read(img: Any, budget: _Budget) -> tuple[list[_Found], bool]:
    """The lines recognised on a BGR image (numpy ``h x w x 3``), in no particular order, and
    whether the image is upside down."""
    import cv2
    import numpy as np

    engine = _engine()
    h, w = img.shape[:2]
    if min(h, w) < MIN_SIDE:
        return [], False
    scale = min(DETECT_UPSCALE, DETECT_SIDE / max(h, w))
    small = img
    if scale != 1.0:
        size = (max(round(w * scale), 1), max(round(h * scale), 1))
        small = cv2.resize(img, size, interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC)
    small, pad = _letterbox(small)
    boxes, _ = engine.text_det(small)
    budget.check()
    if boxes is None or len(boxes) == 0:
        return [], False
    boxes = np.asarray(boxes, dtype=np.float32)
    boxes[:, :, 1] -= pad
    boxes /= scale
    found = [
        (
            max(float(b[:, 0].min()), 0.0),
            max(float(b[:, 1].min()), 0.0),
            min(float(b[:, 0].max()), w),
            min(float(b[:, 1].max()), h),
        )
        for b in boxes
    ]
    crops, turned = _upright([_padded(c) for c in engine.get_crop_img_list(img, list(boxes))])
    budget.check()
    # Lines of like proportions share a batch: each is padded to the widest of its batch.
    order = sorted(range(len(crops)), key=lambda i: crops[i].shape[1] / max(crops[i].shape[0], 1))
    texts: list[tuple[str, float]] = [("", 0.0)] * len(crops)
    for at in range(0, len(order), REC_BATCH):
        idx = order[at : at + REC_BATCH]
        read, _ = engine.text_rec([crops[i] for i in idx])
        for i, (text, score, *_rest) in zip(idx, read, strict=True):
            texts[i] = (str(text), float(score))
        budget.check()
    kept = [
        _Found(text.strip(), *box)
        for box, (text, score) in zip(found, texts, strict=True)
        if score >= MIN_SCORE and text.strip()
    ]
    return kept, turned


def _upright(crops: list[Any]) -> tuple[list[Any], bool]:
    """The lines of a page turned right way up: all of them if the angle classifier finds most
    upside down (a page scanned upside down), else none. Turning lines one by one, as the
    classifier says, turns some right ones wrong: "void * value" read as "(ual * qu ‘anTeAT".
    """
    import numpy as np

    _turned, found, _ = _engine().text_cls(list(crops))
    flipped = sum(1 for label, score in found if label == "180" and score >= FLIP_SCORE)
    if flipped * 2 <= len(crops):
        return crops, False
    return [np.ascontiguousarray(np.rot90(c, 2)) for c in crops], True


def _padded(crop: Any) -> Any:
    """A cut-out line with ``CROP_MARGIN`` of its height added around it in its background's
    colour (the median of its edge pixels): the image's own margin would bring in the ink of the
    lines above and below."""
    import cv2
    import numpy as np

    h = crop.shape[0]
    m = max(round(CROP_MARGIN * h), 1)
    edge = np.concatenate([crop[0], crop[-1], crop[:, 0], crop[:, -1]])
    colour = tuple(float(v) for v in np.median(edge, axis=0))
    return cv2.copyMakeBorder(crop, m, m, m, m, cv2.BORDER_CONSTANT, value=colour)


# Chinese, Japanese and Korean characters and punctuation: written without spaces between them.
_CJK = re.compile(r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]")


def _joined(pieces: Sequence[_Found], language: str) -> str:
    """The pieces of one row as one line, left to right: a space between two pieces, unless
    they overlap (detection cut a word in two) or both sides are Chinese (``zh``)."""
    out = pieces[0].text
    for prev, p in itertools.pairwise(pieces):
        overlap = prev.x1 - p.x0 > 0.2 * min(prev.bottom - prev.top, p.bottom - p.top)
        tight = overlap or (language == "zh" and _CJK.match(out[-1]) and _CJK.match(p.text[0]))
        out += ("" if tight else " ") + p.text
    return out


def _reading_order(found: list[_Found], language: str) -> list[_Found]:
    """Lines in reading order: the pieces that share a row joined left to right, rows top to
    bottom, and a band set in columns read one column after the other."""
    from services.retrieval.core.pdf_layout import reading_groups, rows_of

    if not found:
        return []
    # The finders' ``size`` is a font size: about the height of a detected line.
    size = statistics.median(f.bottom - f.top for f in found)
    lines: list[_Found] = []
    for group in reading_groups(list(found), size):
        for row in rows_of(group):
            pieces = row.items
            lines.append(_Found(_joined(pieces, language), row.x0, row.top, row.x1, row.bottom))
    return lines


def _page(
    number: int, size: tuple[float, float], read: tuple[list[_Found], bool], pixels: Any, language: str
) -> OcrPage:
    """An OcrPage of ``size`` (page units) from what ``_read`` found on its image ``pixels``."""
    found, turned = read
    h, w = pixels.shape[:2]
    unit = size[0] / w

    def turn(f: _Found) -> _Found:  # the upside-down page's boxes, as it reads, and back
        return _Found(f.text, w - f.x1, h - f.bottom, w - f.x0, h - f.top)

    ordered = _reading_order([turn(f) for f in found] if turned else found, language)
    if turned:
        ordered = [turn(f) for f in ordered]
    lines = [
        OcrLine(
            f.text,
            (round(f.x0 * unit, 2), round(f.top * unit, 2), round(f.x1 * unit, 2), round(f.bottom * unit, 2)),
        )
        for f in ordered
    ]
    return OcrPage(number, round(size[0], 2), round(size[1], 2), lines)


# --- PDF pages and image files -------------------------------------------------------------------


def render_scale(width: float, height: float, settings: OcrSettings) -> float:
    """Pixels a PDF point for a page of ``width`` x ``height`` points: ``dpi``, or less where
    that would make more than ``max_pixels``."""
    scale = settings.dpi / 72
    pixels = width * scale * height * scale
    if pixels > settings.max_pixels:
        scale *= math.sqrt(settings.max_pixels / pixels)
    return scale


def ocr_pdf_pages(
    data: bytes, pages: list[int], settings: OcrSettings, *, clock: Callable[[], float] = time.monotonic
) -> list[OcrPage]:
    """Pages ``pages`` (1-based) of the PDF ``data`` rendered with pypdfium2 and read by OCR;
    boxes in PDF points. A page that cannot be read is an OcrPage with ``error``."""
    import numpy as np
    import pypdfium2 as pdfium

    check_language(settings.language)
    if not pages:
        return []
    _engine()  # loaded before any page's clock starts
    doc = pdfium.PdfDocument(data)
    out: list[OcrPage] = []
    try:
        for n in pages:
            page = doc[n - 1]
            try:
                width, height = page.get_size()
                budget = _Budget(settings.page_timeout_s, clock)
                try:
                    if width < 1 or height < 1:
                        raise ValueError(f"the page measures {width:g} x {height:g} points")
                    scale = render_scale(width, height, settings)
                    bitmap = page.render(scale=scale)
                    img = np.ascontiguousarray(bitmap.to_numpy()[:, :, :3])  # pdfium draws BGR
                    bitmap.close()
                    budget.check()
                    out.append(_page(n, (width, height), _read(img, budget), img, settings.language))
                except _PastLimit:
                    out.append(OcrPage(n, round(width, 2), round(height, 2), [], budget.reason()))
                except Exception as exc:  # pdfium and ONNX Runtime raise many kinds of errors
                    why = f"OCR failed: {type(exc).__name__}: {exc}"
                    out.append(OcrPage(n, round(width, 2), round(height, 2), [], why))
            finally:
                page.close()
    finally:
        doc.close()
    return out


def ocr_image(
    filename: str,
    data: bytes,
    settings: OcrSettings,
    *,
    max_pages: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[OcrPage]:
    """The pages of a PNG, JPEG or TIFF file (a TIFF's frames are pages) read by OCR; boxes in
    pixels. A file Pillow cannot open is an InvalidRequest naming it; a frame past
    ``max_pixels``, or one that cannot be decoded or read in time, is an OcrPage with ``error``.
    More frames than ``max_pages`` is a limit error (code ``parse_limit_exceeded``)."""
    import numpy as np
    from PIL import Image, ImageOps, UnidentifiedImageError

    check_language(settings.language)
    try:
        im = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        frames = int(getattr(im, "n_frames", 1)) if im.format == "TIFF" else 1
    except Image.DecompressionBombError as exc:
        raise InvalidRequest(f"file {filename!r}: {exc}", param="file", code="parse_limit_exceeded") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidRequest(
            f"file {filename!r} is not a readable PNG, JPEG or TIFF image: {exc}",
            param="file",
            code="corrupt_file",
        ) from None
    if max_pages is not None and frames > max_pages:
        raise InvalidRequest(
            f"file {filename!r}: {frames} pages (TIFF frames), more than {max_pages} "
            "(limit set by TANDEM_RETRIEVAL_PARSE_MAX_PAGES)",
            param="file",
            code="parse_limit_exceeded",
        )
    _engine()
    out: list[OcrPage] = []
    with im:
        for i in range(frames):
            budget = _Budget(settings.page_timeout_s, clock)
            width = height = 0
            try:
                im.seek(i)
                width, height = im.size
                if width * height > settings.max_pixels:
                    why = (
                        f"the page has {width} x {height} pixels, more than {settings.max_pixels:,} "
                        "(limit set by TANDEM_RETRIEVAL_OCR_MAX_PIXELS)"
                    )
                    out.append(OcrPage(i + 1, width, height, [], why))
                    continue
                frame = ImageOps.exif_transpose(im) if i == 0 else im
                width, height = frame.size
                img = np.ascontiguousarray(np.asarray(frame.convert("RGB"))[:, :, ::-1])
                budget.check()
                out.append(_page(i + 1, (width, height), _read(img, budget), img, settings.language))
            except _PastLimit:
                out.append(OcrPage(i + 1, width, height, [], budget.reason()))
            except Exception as exc:  # a truncated or corrupt frame; ONNX Runtime's errors
                why = f"the page could not be read: {type(exc).__name__}: {exc}"
                out.append(OcrPage(i + 1, width, height, [], why))
    return out
