"""``python -m benchmarks.answers.fetch [--dest DIR] [PACKAGE ...]``: put the documents of the
question sets (and of the reader's training FAQs) in place, from Debian's packages.

Each package is fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into
``DIR/<package>/`` (default ``$TANDEM_ANSWER_DOCS``, else ``~/.cache/tandem/answer-docs``); nothing
is installed on the system and nothing is fetched at run time by the product. Documents Debian compressed
(``*.html.gz``, ``*.pdf.gz``, ``*.txt.gz``) are also written unpacked. A package already
unpacked (its ``.version`` file names the version) is kept. Without package names: every package a
set's manifest (``sets/<set>.json``, ``benchmarks/documents/sets/<set>.json``) names, and the
reader's FAQ packages.

``apt-get download`` needs the package lists: run ``apt-get update`` once first.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# The packages whose FAQs train the reader (``tandem reader dataset``): never a test set's.
READER_PACKAGES = ("perl-doc", "python3.11-doc", "debian-faq", "git-doc")


def docs_dir() -> Path:
    return Path(os.environ.get("TANDEM_ANSWER_DOCS") or Path.home() / ".cache" / "tandem" / "answer-docs")


def unpacked(package: str, dest: Path | None = None) -> Path:
    """Where ``package``'s files are once fetched (its root, holding ``usr/``)."""
    return (dest or docs_dir()) / package


def fetch(package: str, dest: Path) -> Path:
    """``package`` downloaded and unpacked under ``dest``; its root."""
    root = unpacked(package, dest)
    if (root / ".version").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        got = subprocess.run(
            ["apt-get", "download", package], cwd=tmp, capture_output=True, text=True, check=False
        )
        debs = sorted(Path(tmp).glob("*.deb"))
        if got.returncode or not debs:
            raise SystemExit(
                f"apt-get download {package} failed: {got.stderr.strip() or got.stdout.strip()}"
                " (run `apt-get update` once first)"
            )
        deb = debs[0]
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        version = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
        ).stdout.strip()
    # Debian compresses large documents (``faq.pdf.gz``); a reader opens them unpacked.
    for packed in root.rglob("*.gz"):
        if packed.suffixes[-2:-1] in ([".html"], [".pdf"], [".txt"], [".md"]) and packed.is_file():
            packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
    (root / ".version").write_text(version + "\n")
    return root


def main(argv: list[str] | None = None) -> int:
    from benchmarks.answers.sets import DOCUMENT_SETS, SETS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("packages", nargs="*", help="packages to fetch (default: every set's and the reader's)")
    ap.add_argument("--dest", type=Path, default=None, help="where to unpack (default: $TANDEM_ANSWER_DOCS)")
    args = ap.parse_args(argv)
    dest = args.dest or docs_dir()
    sets = [*SETS.values(), *DOCUMENT_SETS.values()]
    wanted = args.packages or sorted({s.package for s in sets if s.package} | set(READER_PACKAGES))
    for package in wanted:
        root = fetch(package, dest)
        print(f"{package} {(root / '.version').read_text().strip()} -> {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
