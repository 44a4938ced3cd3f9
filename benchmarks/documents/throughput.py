"""Pages per minute through the product's parser, as ingestion runs it: the sandboxed child
process of services/retrieval/core/sandbox.py (a fresh interpreter per file, its import time
included) with the limits and OCR settings of the retrieval service's settings.

Each PDF is parsed ``runs`` times; the figure is the median. Several code trees (a checkout
of another commit: ``--tree before=/tmp/old``) are measured in turn, run by run and file by
file, so the machine's load falls on each alike; a tree's parse runs in a process of its own
with that tree first on ``PYTHONPATH`` (``python benchmarks/documents/throughput.py FILE``).
A parse that breaks a limit (the worker's time limit, ``TANDEM_RETRIEVAL_PARSE_TIMEOUT_S``) is
reported as such, and measured again under ``timeout_s`` so its rate is still known.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


def _settings() -> Any:
    from types import SimpleNamespace

    from services.common.config import load_settings
    from services.retrieval.config import RetrievalSettings

    # What ingest.limits_of / ocr_of read of a collection manager: its settings.
    return SimpleNamespace(settings=load_settings(RetrievalSettings, check_unknown=False))


def worker_limits() -> Any:
    """The ParseLimits the ingestion worker uses with the service's settings (ingest.limits_of)."""
    from services.retrieval.ingest import limits_of

    return limits_of(_settings())


def worker_parse() -> Any:
    """``parse(path, limits)`` as the ingestion worker parses an uploaded file: ``parse_stored``
    with the OCR settings of a collection of the default ``ocr_language``, where the code has
    OCR; else ``parse_isolated`` as the worker called it before."""
    from services.retrieval import ingest

    if hasattr(ingest, "parse_stored") and hasattr(ingest, "ocr_of"):
        ocr = ingest.ocr_of(_settings(), "en")
        return lambda path, limits: ingest.parse_stored(path, path.name, limits, ocr=ocr)
    return lambda path, limits: ingest.parse_isolated(path, path.name, limits)


def page_count(path: Path) -> int:
    import pypdfium2 as pdfium

    pdf = pdfium.PdfDocument(str(path))
    try:
        return len(pdf)
    finally:
        pdf.close()


def parse_once(path: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """One parse of ``path`` as the worker parses it (its time limit ``timeout_s`` if given)."""
    from services.common.errors import TandemError

    limits = worker_limits()
    if timeout_s:
        limits = replace(limits, timeout_s=timeout_s)
    parse = worker_parse()
    started = time.perf_counter()
    try:
        docs = parse(path, limits)
    except TandemError as exc:
        return {"seconds": time.perf_counter() - started, "error": exc.message}
    seconds = time.perf_counter() - started
    meta = docs[0].metadata if docs else {}
    return {
        "seconds": seconds,
        "characters": sum(len(d.text) for d in docs),
        "pages_without_text": meta.get("pages_without_text"),
        "timeout_s": limits.timeout_s,
    }


def parse_in(tree: Path | None, path: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """``parse_once`` with the code of ``tree`` (None: this process's)."""
    if tree is None:
        return parse_once(path, timeout_s)
    # This file as a script: the tree's ``services`` are imported, and the tree needs no copy
    # of this benchmark.
    cmd = [sys.executable, str(Path(__file__).resolve()), str(path)]
    cmd += ["--timeout", str(timeout_s)] if timeout_s else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
    }
    got = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if got.returncode:
        raise RuntimeError(f"{tree}: {' '.join(cmd)} failed: {got.stderr.strip()[-500:]}")
    return dict(json.loads(got.stdout.strip().splitlines()[-1]))


def _summary(pages: int, tries: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t["seconds"] for t in tries if "error" not in t]
    out: dict[str, Any] = {"runs": tries}
    if ok and len(ok) == len(tries):
        out["median_s"] = statistics.median(ok)
        out["pages_per_minute"] = pages / out["median_s"] * 60
    return out


def measure(
    files: dict[str, Path], trees: dict[str, Path | None], *, runs: int = 3, timeout_s: float | None = None
) -> dict[str, Any]:
    """``{tree: {kind: {pages, runs, median_s, pages_per_minute, ...}}}``: every file parsed
    ``runs`` times by every tree, interleaved; a file a tree's worker limit stopped is parsed
    ``runs`` times more under ``timeout_s``."""
    pages = {kind: page_count(path) for kind, path in files.items()}
    tries: dict[str, dict[str, list[dict[str, Any]]]] = {t: {k: [] for k in files} for t in trees}
    for _ in range(runs):
        for kind, path in files.items():
            for name, tree in trees.items():
                tries[name][kind].append(parse_in(tree, path))
    longer: dict[str, dict[str, list[dict[str, Any]]]] = {t: {} for t in trees}
    for _ in range(runs):
        for kind, path in files.items():
            for name, tree in trees.items():
                if timeout_s and any("error" in t for t in tries[name][kind]):
                    longer[name].setdefault(kind, []).append(parse_in(tree, path, timeout_s))
    out: dict[str, Any] = {}
    for name in trees:
        out[name] = {}
        for kind, path in files.items():
            entry = {"file": str(path), "pages": pages[kind], **_summary(pages[kind], tries[name][kind])}
            if kind in longer[name]:
                entry["longer_timeout_s"] = timeout_s
                entry["longer_timeout"] = _summary(pages[kind], longer[name][kind])
            out[name][kind] = entry
    return out


def excerpt(src: Path, dst: Path, first: int, last: int) -> Path:
    """Pages ``first``..``last`` (1-based, inclusive) of ``src`` as a PDF of their own (pypdf)."""
    from pypdf import PdfReader, PdfWriter

    reader = PdfReader(str(src))
    writer = PdfWriter()
    for i in range(first - 1, last):
        writer.add_page(reader.pages[i])
    dst.parent.mkdir(parents=True, exist_ok=True)
    with dst.open("wb") as f:
        writer.write(f)
    return dst


if __name__ == "__main__":  # one parse, for ``parse_in``: its result as a JSON line
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args()
    print(json.dumps(parse_once(args.file, args.timeout)))
