"""The question sets shipped in ``benchmarks/answers/sets/`` and the documents each is about.

Each set is a JSONL file of questions (format: ``services/cli/eval_questions.py``) written
from its documents by reading them, and a manifest beside it, ``<set>.json``:

- ``package``: the Debian package whose documentation it is (null: this repository's ``docs/``);
  ``python -m benchmarks.answers.fetch`` downloads and unpacks it (``apt-get download``,
  ``dpkg-deb -x``) under ``$TANDEM_ANSWER_DOCS``; nothing is fetched at run time;
- ``version``: the package version the questions were written for (another may move a fact);
- ``root`` (a folder inside the package, or of the repository) and ``files`` (glob patterns);
- ``format`` (``markdown``, ``html``, ``pdf``), ``licence``;
- ``role``: ``tuning`` or ``test``. The split is by document set and was fixed before anything
  was tuned: the answer step's thresholds are chosen on the tuning sets only, and figures are
  reported on the test sets and leave-one-set-out. No set whose package trains the reader
  (``fetch.READER_PACKAGES``) is a set here.

``--set tuning`` / ``test`` / ``all`` name the groups; a set also runs by its name.

The sets of ``benchmarks/documents/sets/`` (scans, tables, two columns) load the same way into
``DOCUMENT_SETS`` and run by their names, in none of those groups. A manifest's ``made`` names
how ``python -m benchmarks.documents make`` makes the set's documents from the package's files
(``root``/``made_from``), under ``$TANDEM_ANSWER_DOCS/made/<set>/``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from benchmarks.agent.stack import REPO
from benchmarks.answers.fetch import docs_dir

SETS_DIR = Path(__file__).resolve().parent / "sets"
DOCUMENT_SETS_DIR = Path(__file__).resolve().parents[1] / "documents" / "sets"
Role = Literal["tuning", "test"]


@dataclass(frozen=True)
class QuestionSet:
    name: str
    package: str | None  # the Debian package of the documents; None: the repository's
    version: str
    root_in: str  # folder of the documents, inside the package (or the repository)
    files: tuple[str, ...]  # document files under root (glob patterns)
    kind: str  # markdown | html | pdf
    licence: str
    role: Role
    folder: Path = SETS_DIR  # where the set's questions and manifest are
    made: str | None = None  # how its documents are made from ``made_from`` (benchmarks/documents)
    made_from: tuple[str, ...] = ()

    @property
    def held_out(self) -> bool:
        return self.role == "test"

    @property
    def root(self) -> Path:
        if self.made:
            return docs_dir() / "made" / self.name
        return self.source_root

    @property
    def source_root(self) -> Path:
        return (docs_dir() / self.package if self.package else REPO) / self.root_in

    @property
    def install(self) -> str:
        if self.package is None:
            return "they are in the repository"
        if self.made:
            return f"make them with `python -m benchmarks.documents make` (after fetching {self.package})"
        return f"fetch them with `python -m benchmarks.answers.fetch {self.package}`"

    @property
    def questions(self) -> Path:
        return self.folder / f"{self.name}.jsonl"

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


def _load(manifest: Path) -> QuestionSet:
    data = json.loads(manifest.read_text())
    return QuestionSet(
        name=manifest.stem,
        package=data["package"],
        version=data.get("version", ""),
        root_in=data["root"],
        files=tuple(data["files"]),
        kind=data["format"],
        licence=data["licence"],
        role=data["role"],
        folder=manifest.parent,
        made=data.get("made"),
        made_from=tuple(data.get("made_from", ())),
    )


SETS: dict[str, QuestionSet] = {m.stem: _load(m) for m in sorted(SETS_DIR.glob("*.json"))}
DOCUMENT_SETS: dict[str, QuestionSet] = {m.stem: _load(m) for m in sorted(DOCUMENT_SETS_DIR.glob("*.json"))}


def chosen_sets(names: str) -> list[str]:
    """``names`` comma-separated; ``tuning``, ``test`` and ``all`` name groups of sets."""
    out: list[str] = []
    for name in (n for n in names.split(",") if n):
        if name == "all":
            out += list(SETS)
        elif name in ("tuning", "test"):
            out += [n for n, s in SETS.items() if s.role == name]
        else:
            out.append(name)
    return list(dict.fromkeys(out))


def get_set(name: str) -> QuestionSet:
    try:
        return SETS.get(name) or DOCUMENT_SETS[name]
    except KeyError:
        raise KeyError(
            f"no question set {name!r}; the sets are {', '.join([*SETS, *DOCUMENT_SETS])}"
        ) from None


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
