"""``python -m benchmarks.documents make|run|throughput|table``: documents as people have them
(a scanned manual, tables, two columns) through Tandem's parsers, measured
(benchmarks/documents/README.md).

- ``make``: the documents made from real ones, under ``$TANDEM_ANSWER_DOCS/made/``: the libtasn1
  manual scanned (``made.scan_pdf``), each two-column set's HTML printed in two columns
  (``made.print_two_columns``) and the table-heavy excerpt the throughput figure parses.
- ``run --home H --out DIR [--set scanned,NAME,...]``: on the running stack of ``H``, each set
  ingested into a collection of its own and measured (measure.py): nDCG@10 by page and the
  answers of ``chat-documents``. ``scanned`` is the libtasn1-pdf set on the born-digital manual
  and on its scan, in two collections.
- ``throughput --out DIR [--tree NAME=DIR]``: pages per minute of born-digital, scanned and
  table-heavy PDFs through the sandboxed parser (throughput.py), median of ``--runs``; with
  ``--tree``, another checkout's parser too, interleaved.
- ``table DIR [DIR ...]``: the figures of ``run`` outputs side by side, as Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

SCANNED = "scanned"
SCANNED_FROM = "libtasn1-pdf"  # a real manual of 36 pages with a question set of its own
DPI = 200
# Pages of debian-reference.en.pdf dense with tables (package lists, key bindings, keywords).
TABLE_HEAVY_PAGES = (221, 256)


def made_dir() -> Path:
    from benchmarks.answers.fetch import docs_dir

    return docs_dir() / "made"


def scanned_paths() -> tuple[Path, Path]:
    """(the born-digital original, its scan)."""
    from benchmarks.answers.sets import get_set

    original = get_set(SCANNED_FROM).documents()[0]
    return original, made_dir() / SCANNED / original.name


def table_heavy_source() -> Path:
    from benchmarks.answers.sets import get_set

    return get_set("debian-reference-pdf").documents()[0]


def table_heavy_path() -> Path:
    first, last = TABLE_HEAVY_PAGES
    return made_dir() / "throughput" / f"debian-reference-p{first}-{last}.pdf"


def make() -> int:
    from benchmarks.answers.sets import DOCUMENT_SETS
    from benchmarks.documents.made import print_two_columns, scan_pdf
    from benchmarks.documents.throughput import excerpt

    original, scan = scanned_paths()
    pages = scan_pdf(original, scan, DPI)
    print(f"{scan}: {pages} pages at {DPI} dpi, no text layer", file=sys.stderr)
    for qs in DOCUMENT_SETS.values():
        if qs.made == "two-columns":
            made = print_two_columns([qs.source_root / f for f in qs.made_from], qs.root)
            print(f"{qs.name}: {', '.join(str(p) for p in made)}", file=sys.stderr)
        elif qs.made:
            raise SystemExit(f"set {qs.name}: unknown way of making its documents: {qs.made!r}")
    first, last = TABLE_HEAVY_PAGES
    print(f"{excerpt(table_heavy_source(), table_heavy_path(), first, last)}", file=sys.stderr)
    return 0


def units(names: str) -> list[tuple[str, str, list[Path], Path, list[str]]]:
    """(result name, collection, files, questions file, texts groundedness is judged against)."""
    from benchmarks.answers.sets import DOCUMENT_SETS, flat_texts, get_set, set_pages

    wanted = [SCANNED, *DOCUMENT_SETS] if names == "all" else [n for n in names.split(",") if n]
    out = []
    for name in wanted:
        if name == SCANNED:
            qs = get_set(SCANNED_FROM)
            original, scan = scanned_paths()
            if not scan.is_file():
                raise SystemExit(f"no {scan}: run `python -m benchmarks.documents make`")
            texts = flat_texts(set_pages(qs))  # groundedness against the original's text
            out.append(
                (f"{SCANNED_FROM}-born-digital", f"documents-{SCANNED_FROM}", [original], qs.questions, texts)
            )
            out.append(
                (f"{SCANNED_FROM}-scanned", f"documents-{SCANNED_FROM}-scanned", [scan], qs.questions, texts)
            )
        else:
            qs = get_set(name)
            out.append((name, f"documents-{name}", qs.documents(), qs.questions, flat_texts(set_pages(qs))))
    return out


def run(names: str, home: Path, out: Path, show: bool) -> int:
    from benchmarks.answers.real_documents import stack_where
    from benchmarks.answers.sets import MissingDocuments
    from benchmarks.documents.measure import measure, write

    try:
        chosen = units(names)
    except (KeyError, MissingDocuments) as exc:
        raise SystemExit(str(exc).strip("'\"")) from None
    where = stack_where(home)
    for name, collection, paths, questions, texts in chosen:
        result = measure(where, collection, paths, questions, texts, show=show)
        print(f"{write(out, name, result)}", file=sys.stderr)
        print(markdown([(name, result)]))
    return 0


ROWS: list[tuple[str, str]] = [
    ("ingestion", "ingestion job"),
    ("chunks", "chunks"),
    ("ndcg", "retrieval nDCG@10 by page"),
    ("answer_stated", "answer stated"),
    ("right_source_cited", "right document cited"),
    ("right_page_or_section_cited", "right page cited"),
    ("abstained_when_unanswerable", 'unanswerable answered "not found"'),
    ("false_abstention", 'false "not found"'),
    ("not_found", '"not found" (all questions)'),
]


def cells(result: dict[str, Any]) -> dict[str, str]:
    s = result["summary"]
    r = result.get("retrieval") or {}
    ing = result.get("ingest") or {}
    status = ing.get("status", "?")
    if ing.get("file_errors"):
        status += ": " + "; ".join(e["message"] for e in ing["file_errors"])[:160]
    elif ing.get("error"):
        status += ": " + str(ing["error"])[:160]
    n_yes, n_no = s["answerable"], s["unanswerable"]

    def share(key: str, n: int) -> str:
        v = s.get(key)
        return "n/a" if v is None else f"{round(v * n)} of {n} ({100 * v:.1f}%)"

    ndcg = r.get("ndcg@10")
    return {
        "ingestion": status,
        "chunks": str(r.get("chunks", "n/a")),
        "ndcg": "n/a" if ndcg is None else f"{ndcg:.3f} ({r['questions']} questions)",
        "answer_stated": share("answer_stated", n_yes),
        "right_source_cited": share("right_source_cited", n_yes),
        "right_page_or_section_cited": share("right_page_or_section_cited", n_yes),
        "abstained_when_unanswerable": share("abstained_when_unanswerable", n_no),
        "false_abstention": share("false_abstention", n_yes),
        "not_found": share("not_found", n_yes + n_no),
    }


def markdown(results: list[tuple[str, dict[str, Any]]]) -> str:
    head = "| | " + " | ".join(f"`{n}`" for n, _ in results) + " |"
    lines = [head, "| --- |" + " ---: |" * len(results)]
    table = [cells(r) for _, r in results]
    for key, label in ROWS:
        lines.append(f"| {label} | " + " | ".join(t[key] for t in table) + " |")
    return "\n".join(lines)


def table(dirs: list[Path]) -> int:
    results = []
    for d in dirs:
        for f in sorted(d.glob("*.json")):
            data = json.loads(f.read_text())
            if "summary" in data:
                results.append((f"{d.name}/{f.stem}", data))
    print(markdown(results))
    return 0


def throughput(out: Path, runs: int, timeout_s: float | None, trees: list[str]) -> int:
    from benchmarks.documents.measure import write
    from benchmarks.documents.throughput import measure

    original, scan = scanned_paths()
    files = {
        "born-digital": original,
        "scanned": scan,
        "table-heavy": table_heavy_path(),
        "whole-book": table_heavy_source(),  # the 261 pages the table-heavy ones are cut from
    }
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"no {', '.join(missing)}: run `python -m benchmarks.documents make`")
    named: dict[str, Path | None] = {"this": None}
    for spec in trees:
        name, _, folder = spec.partition("=")
        if not folder or not (Path(folder) / "services").is_dir():
            raise SystemExit(f"--tree {spec!r}: give NAME=DIR, DIR a checkout holding services/")
        named[name] = Path(folder).resolve()
    result = measure(files, named, runs=runs, timeout_s=timeout_s)
    result["cpus"] = os.cpu_count()
    result["load_average"] = os.getloadavg()
    print(f"{write(out, 'throughput', result)}", file=sys.stderr)
    for name in named:
        for kind, r in result[name].items():
            rate = r.get("pages_per_minute")
            errors = sorted({t["error"] for t in r["runs"] if "error" in t})
            said = f"{rate:.1f} pages/min (median {r['median_s']:.1f} s)" if rate else "; ".join(errors)
            longer = r.get("longer_timeout", {}).get("pages_per_minute")
            said += f"; under a {timeout_s:g} s limit {longer:.1f} pages/min" if longer else ""
            print(f"{name:<8} {kind:<13} {r['pages']:>4} pages  {said}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.documents", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("make", help="make the scanned, two-column and excerpt PDFs from the fetched packages")
    r = sub.add_parser("run", help="measure the sets on a running stack")
    r.add_argument("--set", default="all", help=f"'{SCANNED}', a set of benchmarks/documents/sets, or 'all'")
    r.add_argument("--home", type=Path, default=Path(os.environ.get("TANDEM_HOME", ".tandem")))
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--show", action="store_true", help="print each judged answer")
    t = sub.add_parser("throughput", help="pages per minute through the sandboxed parser")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--runs", type=int, default=3)
    t.add_argument("--timeout", type=float, default=1800.0,
                   help="a longer time limit to measure a file the worker's limit stops at")  # fmt: skip
    t.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="also measure the code of another checkout, interleaved with this one's")  # fmt: skip
    tb = sub.add_parser("table", help="the figures of run outputs side by side")
    tb.add_argument("dirs", type=Path, nargs="+")
    args = ap.parse_args(argv)
    if args.command == "make":
        return make()
    if args.command == "run":
        return run(args.set, args.home, args.out, args.show)
    if args.command == "throughput":
        return throughput(args.out, args.runs, args.timeout, args.tree)
    return table(args.dirs)


if __name__ == "__main__":
    raise SystemExit(main())
