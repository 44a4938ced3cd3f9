"""The ``docs`` collection a newcomer can chat with on the first start of the stack.

``ensure_docs_collection`` creates collection ``docs`` through the retrieval service's
API (as the tenant of the key it is given) and ingests the project's README.md and
docs/*.md into it, once: when the collection already exists it does nothing, so a
later start never re-ingests or overwrites what the user changed. Document ids are the
file paths with '/' as '-' (``README.md``, ``docs-web.md``) so they stay one URL
segment; re-sending a file with the same id replaces it (the retrieval API's contract),
which makes ``force=True`` a clean refresh.

Usage from ``tandem up`` (after retrieval and the io worker are ready), with the key of
the tenant people sign in as::

    from services.cli.bootstrap_docs import ensure_docs_collection
    ensure_docs_collection(common.url_of("retrieval"), default_key)

or by hand: ``python -m services.cli.bootstrap_docs --url URL --key-file $TANDEM_HOME/api-key``.
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common.jobs import TERMINAL

COLLECTION = "docs"
REPO_ROOT = Path(__file__).resolve().parents[2]


class BootstrapError(RuntimeError):
    pass


@dataclass
class BootstrapResult:
    created: bool
    documents: list[str] = field(default_factory=list)


def doc_files(root: Path = REPO_ROOT) -> list[Path]:
    """README.md and docs/*.md (sorted), those that exist."""
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    docs = root / "docs"
    if docs.is_dir():
        files += sorted(p for p in docs.glob("*.md") if p.is_file())
    return files


def doc_id(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix().replace("/", "-")


def title_of(text: str, fallback: str) -> str:
    """The first Markdown heading, else the file name."""
    m = re.search(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE)
    return m.group(1).strip() if m else fallback


def _error(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error", {})
        return str(err.get("message") or resp.text)
    except ValueError:
        return resp.text[:300]


def _wait_for_job(client: httpx.Client, job_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        resp = client.get(f"/v1/jobs/{job_id}")
        if resp.status_code != 200:
            raise BootstrapError(f"ingestion job {job_id}: HTTP {resp.status_code}: {_error(resp)}")
        job = resp.json()
        status = job["status"]  # services/common/jobs.py's vocabulary
        if status == "succeeded":
            return
        if status in TERMINAL:
            raise BootstrapError(f"ingestion job {job_id} {status}: {job.get('error')}")
        if time.monotonic() > deadline:
            raise BootstrapError(f"ingestion job {job_id} still {status!r} after {timeout:.0f}s")
        time.sleep(0.5)


def ensure_docs_collection(
    retrieval_url: str,
    api_key: str,
    *,
    root: Path = REPO_ROOT,
    collection: str = COLLECTION,
    force: bool = False,
    timeout: float = 300.0,
    transport: httpx.BaseTransport | None = None,
) -> BootstrapResult:
    """Create ``collection`` from the repo's docs unless it exists (``force`` re-sends the files).

    Raises BootstrapError with the service's message when a call fails; a missing README
    or docs folder just means fewer documents.
    """
    with httpx.Client(
        base_url=retrieval_url.rstrip("/"),
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=timeout,
        transport=transport,
    ) as client:
        resp = client.get(f"/v1/collections/{collection}")
        if resp.status_code == 200 and not force:
            return BootstrapResult(created=False)
        created = False
        if resp.status_code == 404:
            made = client.post("/v1/collections", json={"name": collection})
            if made.status_code not in (200, 201, 409):
                raise BootstrapError(
                    f"creating collection {collection!r}: HTTP {made.status_code}: {_error(made)}"
                )
            created = made.status_code != 409
        elif resp.status_code != 200:
            raise BootstrapError(
                f"reading collection {collection!r}: HTTP {resp.status_code}: {_error(resp)}"
            )

        documents: list[dict[str, object]] = []
        ids: list[str] = []
        for path in doc_files(root):
            text = path.read_text(encoding="utf-8", errors="replace")
            if not text.strip():
                continue
            rel = path.relative_to(root).as_posix()
            ids.append(doc_id(path, root))
            documents.append(
                {
                    "id": ids[-1],
                    "text": text,
                    "title": title_of(text, rel),
                    "metadata": {"source": rel, "kind": "project-docs"},
                }
            )
        if documents:
            sent = client.post(f"/v1/collections/{collection}/documents", json={"documents": documents})
            if sent.status_code not in (200, 201, 202):
                raise BootstrapError(f"ingesting the docs: HTTP {sent.status_code}: {_error(sent)}")
            # 202 with a job id when the documents became an ingestion job; 201 when done already.
            job = sent.json().get("job_id")
            if job:
                _wait_for_job(client, str(job), timeout)
        return BootstrapResult(created=created, documents=ids)


def main() -> None:
    parser = argparse.ArgumentParser(description="Create the `docs` collection from README.md and docs/*.md.")
    parser.add_argument("--url", required=True, help="retrieval service base URL, e.g. http://127.0.0.1:8002")
    parser.add_argument(
        "--key-file", type=Path, required=True, help="file holding the API key (tenant to own it)"
    )
    parser.add_argument(
        "--force", action="store_true", help="re-send the files even if the collection exists"
    )
    args = parser.parse_args()
    result = ensure_docs_collection(args.url, args.key_file.read_text().strip(), force=args.force)
    if result.documents:
        print(
            f"ingested {len(result.documents)} documents into `{COLLECTION}`: {', '.join(result.documents)}"
        )
    else:
        print(f"collection `{COLLECTION}` already exists; nothing to do (use --force to refresh)")


if __name__ == "__main__":
    main()
