"""The question sets shipped in ``benchmarks/answers/sets/`` and the documents each is about.

Each set is a JSONL file of questions (format: ``services/cli/eval_questions.py``) written
from its documents by reading them, and a list of document files:

| set | documents | format | licence | where they come from |
| --- | --- | --- | --- | --- |
| ``tandem-docs`` | ``docs/*.md`` of this repository | Markdown | the project's | the repository |
| ``valgrind-html`` | Valgrind 3.19 manual: ``quick-start.html``, ``manual-intro.html``, ``faq.html`` | HTML | GNU GPL v2+ (Debian's copyright file for the package) | ``apt-get install valgrind`` installs ``/usr/share/doc/valgrind/html/`` |
| ``libtasn1-pdf`` | GNU Libtasn1 4.19 manual, ``libtasn1.pdf`` (36 pages) | PDF | GNU FDL 1.3 or later | ``apt-get install libtasn1-doc`` installs ``/usr/share/doc/libtasn1-doc/`` |
| ``sqlite-html`` (held out) | SQLite 3.40 documentation: ``faq.html``, ``autoinc.html``, ``quirks.html`` | HTML | public domain | ``apt-get install sqlite3-doc`` installs ``/usr/share/doc/sqlite3/`` |

``sqlite-html`` is held out: its questions were written after the answer step's rules and weights
were chosen on the other three, and nothing is tuned on it; ``all`` (the tuning sets) leaves it
out, so it runs by name only.

Nothing is fetched at run time: the two Debian packages are installed beforehand (the
documented step), and a set whose documents are missing is refused with that step named.
The questions were written for the versions above (Debian 12's ``valgrind 1:3.19.0-1`` and
``libtasn1-doc 4.19.0-2+deb12u1``); another version may move or reword a fact.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.agent.stack import REPO

SETS_DIR = Path(__file__).resolve().parent / "sets"


@dataclass(frozen=True)
class QuestionSet:
    name: str
    root: Path  # folder of the documents
    files: tuple[str, ...]  # document files under root (glob patterns)
    kind: str  # markdown | html | pdf
    licence: str
    install: str  # how the documents get onto the machine
    held_out: bool = False  # never tuned on; not in "all"

    @property
    def questions(self) -> Path:
        return SETS_DIR / f"{self.name}.jsonl"

    @property
    def collection(self) -> str:
        return f"answers-{self.name}"

    def documents(self) -> list[Path]:
        """The set's document files, sorted; ``MissingDocuments`` naming the install step when
        any pattern matches nothing."""
        out: list[Path] = []
        for pattern in self.files:
            found = sorted(p for p in self.root.glob(pattern) if p.is_file())
            if not found:
                raise MissingDocuments(f"set {self.name!r}: no {self.root / pattern}; {self.install}")
            out += found
        return out


class MissingDocuments(RuntimeError):
    pass


SETS: dict[str, QuestionSet] = {
    s.name: s
    for s in (
        QuestionSet(
            "tandem-docs",
            REPO / "docs",
            ("*.md",),
            "markdown",
            "the project's own documentation",
            "they are in the repository",
        ),
        QuestionSet(
            "valgrind-html",
            Path("/usr/share/doc/valgrind/html"),
            ("quick-start.html", "manual-intro.html", "faq.html"),
            "html",
            "GNU GPL v2 or later",
            "install them with `apt-get install valgrind` (the package ships its HTML manual)",
        ),
        QuestionSet(
            "libtasn1-pdf",
            Path("/usr/share/doc/libtasn1-doc"),
            ("libtasn1.pdf",),
            "pdf",
            "GNU FDL 1.3 or later",
            "install it with `apt-get install libtasn1-doc`",
        ),
        QuestionSet(
            "sqlite-html",
            Path("/usr/share/doc/sqlite3"),
            ("faq.html", "autoinc.html", "quirks.html"),
            "html",
            "public domain",
            "install them with `apt-get install sqlite3-doc` (the package ships SQLite's HTML documentation)",
            held_out=True,
        ),
    )
}


def chosen_sets(names: str) -> list[str]:
    """``names`` comma-separated, or ``all``: every set but the held-out ones."""
    if names == "all":
        return [n for n, s in SETS.items() if not s.held_out]
    return [n for n in names.split(",") if n]


def get_set(name: str) -> QuestionSet:
    try:
        return SETS[name]
    except KeyError:
        raise KeyError(f"no question set {name!r}; the sets are {', '.join(SETS)}") from None


# -- the documents' text (what the peer pipeline reads, and groundedness is judged against) -------


@dataclass(frozen=True)
class Page:
    """Text of one document, or of one page of a PDF (``page`` 1-based)."""

    source: str  # the file name
    text: str
    page: int | None = None


def html_text(data: bytes) -> str:
    """The page's text as the LangChain tutorial's loader takes it (BeautifulSoup's get_text)."""
    from bs4 import BeautifulSoup

    return BeautifulSoup(data, "html.parser").get_text()


def pages_of(path: Path) -> list[Page]:
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        from pypdf import PdfReader

        reader = PdfReader(str(path))
        return [Page(path.name, p.extract_text() or "", n) for n, p in enumerate(reader.pages, start=1)]
    data = path.read_bytes()
    text = html_text(data) if suffix in (".html", ".htm") else data.decode("utf-8", errors="replace")
    return [Page(path.name, text)]


def set_pages(qs: QuestionSet) -> list[Page]:
    return [p for path in qs.documents() for p in pages_of(path) if p.text.strip()]


def flat_texts(pages: list[Page]) -> list[str]:
    """One text per page, runs of blank space folded (what groundedness is judged against)."""
    return [re.sub(r"[ \t]+", " ", p.text) for p in pages]


# -- ingestion into Tandem ----------------------------------------------------------------------


def ensure_collection(client: httpx.Client, qs: QuestionSet, timeout: float = 1800) -> bool:
    """Creates the set's collection and uploads its files through ``/files`` (Tandem's own
    parsers for HTML and PDF); does nothing when the collection exists. True if it was made."""
    from services.cli.bootstrap_docs import _wait_for_job

    if client.get(f"/v1/collections/{qs.collection}").status_code == 200:
        return False
    paths = qs.documents()
    client.post("/v1/collections", json={"name": qs.collection}).raise_for_status()
    files = [("file", (p.name, p.read_bytes())) for p in paths]
    resp = client.post(
        f"/v1/collections/{qs.collection}/files",
        files=files,
        data={"metadata": json.dumps({"set": qs.name})},
        timeout=timeout,
    )
    resp.raise_for_status()
    job = resp.json().get("job_id")
    if job:
        _wait_for_job(client, str(job), timeout)
    return True
