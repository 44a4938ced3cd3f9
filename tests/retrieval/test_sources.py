"""Sources a collection follows: a real Git repository made with ``git`` here and changed
between syncs, a small website served by ``http.server`` in a thread, and server folders. Syncs
run as the io worker runs them (``ingest.run_leased`` on the job the API queued)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.retrieval.sources.globs import matcher
from tests.conftest import auth
from tests.helpers.servers import serve_app

TENANT = "acme"


# -- the service, with sources allowed under a folder of the test ---------------------------------


@pytest.fixture()
def roots(tmp_path: Path) -> Path:
    folder = tmp_path / "allowed"
    folder.mkdir()
    return folder


@pytest.fixture()
def app(retrieval_env: Path, roots: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from services.retrieval.app import create_app

    monkeypatch.setenv("TANDEM_RETRIEVAL_SOURCE_ROOTS", str(roots))
    # the test's website is on 127.0.0.1
    monkeypatch.setenv("TANDEM_RETRIEVAL_SOURCE_ALLOW_PRIVATE", "true")
    monkeypatch.setenv("TANDEM_RETRIEVAL_SOURCE_WEB_MAX_DEPTH", "2")
    application = create_app()
    with serve_app(application) as url:
        application.state.url = url
        yield application


@pytest.fixture()
def client(app: Any, api_key: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=app.state.url, headers=auth(api_key), timeout=60) as c:
        # the first collection of a test process loads the embedding model: give it time
        c.post("/v1/collections", json={"name": "kb"}, timeout=600).raise_for_status()
        yield c


def add_source(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/collections/kb/sources", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def sync(app: Any, client: httpx.Client, source_id: str) -> dict[str, Any]:
    """Sync now, run the queued job as the io worker does, and return the job."""
    from services.retrieval.ingest import run_leased

    r = client.post(f"/v1/collections/kb/sources/{source_id}/sync")
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    s = app.state
    run_leased(s.collections, s.jobs, s.settings, TENANT, "kb", job_id)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["kind"] == "sync" and job["source_id"] == source_id
    return dict(job)


def doc_ids(client: httpx.Client) -> set[str]:
    r = client.get("/v1/collections/kb/documents", params={"limit": 1000})
    return {d["id"] for d in r.json()["documents"]}


class EmbedCounter:
    """Every text the collection embeds for documents, from here on."""

    def __init__(self, app: Any) -> None:
        col = app.state.collections.get(TENANT, "kb")
        self.texts: list[str] = []
        original = col.embedder.embed_documents

        def counting(texts: list[str]) -> Any:
            self.texts.extend(texts)
            return original(texts)

        col.embedder.embed_documents = counting  # type: ignore[method-assign]


# -- a Git repository made with git ------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(repo.parent),
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
    }
    out = subprocess.run(
        ["git", "-c", "user.name=Test", "-c", "user.email=test@example.com", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        check=True,
    )
    return out.stdout.decode().strip()


def make_repo(repo: Path, files: dict[str, str]) -> Path:
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    commit(repo, files, "first")
    return repo


def commit(repo: Path, files: dict[str, str | None], message: str) -> None:
    for rel, text in files.items():
        path = repo / rel
        if text is None:
            git(repo, "rm", "-q", rel)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        git(repo, "add", rel)
    git(repo, "commit", "-q", "-m", message)


REPO_FILES = {
    "README.md": "# Lighthouse keeping\n\nKeepers trimmed the wick every four hours.\n",
    "docs/lens.md": "# Fresnel lens\n\nThe Fresnel lens bends light with concentric prisms.\n",
    "docs/fog.md": "# Fog signals\n\nA diaphone horn sounds twice a minute in fog.\n",
    "old.txt": "Whale oil lamps were replaced by kerosene in the 1880s.\n",
    "tools/build.py": "print('not a document')\n",
}


def test_a_git_source_syncs_only_what_changed(app: Any, client: httpx.Client, roots: Path) -> None:
    repo = make_repo(roots / "lighthouse", REPO_FILES)
    source = add_source(client, type="git", url=repo.as_uri(), interval_minutes=60)
    assert source["id"].startswith("src_") and source["paths"] == ["**"]
    assert source["next_sync_at"] is not None and source["last_sync"] is None
    sid = source["id"]

    first = sync(app, client, sid)
    assert first["status"] == "succeeded", first
    assert {k: first["result"][k] for k in ("added", "changed", "removed", "failed", "unchanged")} == {
        "added": 4,
        "changed": 0,
        "removed": 0,
        "failed": 0,
        "unchanged": 0,
    }
    assert first["result"]["commit"] == git(repo, "rev-parse", "HEAD")
    # documents are "<source id>:<path>"; the .py file is no format a parser reads
    assert doc_ids(client) == {
        f"{sid}:README.md",
        f"{sid}:docs/lens.md",
        f"{sid}:docs/fog.md",
        f"{sid}:old.txt",
    }
    lens = client.get(f"/v1/collections/kb/documents/{sid}:docs/lens.md").json()
    assert lens["metadata"]["source"] == "docs/lens.md" and lens["metadata"]["source_id"] == sid
    readme_before = client.get(f"/v1/collections/kb/documents/{sid}:README.md").json()

    commit(
        repo,
        {
            "docs/lens.md": "# Fresnel lens\n\nA first-order lens weighs more than six tonnes.\n",
            "docs/storms.md": "# Storms\n\nStorm panes protect the lantern room glazing.\n",
            "old.txt": None,
        },
        "second",
    )
    embedded = EmbedCounter(app)
    second = sync(app, client, sid)
    assert second["status"] == "succeeded", second
    result = second["result"]
    assert (result["changed"], result["added"], result["removed"], result["unchanged"], result["failed"]) == (
        1,
        1,
        1,
        2,
        0,
    )
    # only the changed, added and removed files were work: the two unchanged ones were not parsed
    assert second["documents_total"] == 3
    joined = "\n".join(embedded.texts)
    assert "six tonnes" in joined and "Storm panes" in joined
    assert "wick" not in joined and "diaphone" not in joined  # unchanged files: not embedded again
    assert doc_ids(client) == {
        f"{sid}:README.md",
        f"{sid}:docs/lens.md",
        f"{sid}:docs/fog.md",
        f"{sid}:docs/storms.md",
    }
    assert client.get(f"/v1/collections/kb/documents/{sid}:old.txt").status_code == 404
    lens = client.get(f"/v1/collections/kb/documents/{sid}:docs/lens.md").json()
    assert "six tonnes" in client.get(f"/v1/collections/kb/documents/{sid}:docs/lens.md").json()["text"]
    assert lens["metadata"]["source"] == "docs/lens.md"
    readme_after = client.get(f"/v1/collections/kb/documents/{sid}:README.md").json()
    assert readme_after["updated_at"] == readme_before["updated_at"]
    hits = client.post(
        "/v1/collections/kb/search", json={"query": "storm panes lantern", "mode": "sparse"}
    ).json()
    assert hits["results"][0]["document_id"] == f"{sid}:docs/storms.md"

    shown = client.get(f"/v1/collections/kb/sources/{sid}").json()
    assert shown["last_sync"]["status"] == "succeeded" and shown["last_sync"]["job_id"] == second["id"]
    assert shown["last_sync"]["counts"]["changed"] == 1
    assert shown["files"] == 4 and shown["documents"] == 4 and shown["syncing_job"] is None
    assert shown["next_sync_at"] == pytest.approx(shown["last_sync"]["finished_at"] + 3600)

    third = sync(app, client, sid)  # nothing changed: nothing to do
    assert third["result"]["unchanged"] == 4 and third["documents_total"] == 0


def test_a_git_source_takes_its_branch_and_globs(app: Any, client: httpx.Client, roots: Path) -> None:
    repo = make_repo(roots / "handbook", {"docs/main.md": "# Main\n\nOn the main branch.\n"})
    git(repo, "checkout", "-q", "-b", "release")
    commit(
        repo,
        {
            "docs/release.md": "# Release\n\nOnly on the release branch.\n",
            "docs/deep/notes.txt": "Deep notes of the release.\n",
            "CHANGES.md": "# Changes\n\nNot under docs.\n",
        },
        "release",
    )
    git(repo, "checkout", "-q", "main")
    source = add_source(
        client, type="git", url=repo.as_uri(), branch="release", paths=["docs/**/*.md", "docs/deep/*.txt"]
    )
    job = sync(app, client, source["id"])
    assert job["status"] == "succeeded", job
    sid = source["id"]
    assert doc_ids(client) == {f"{sid}:docs/main.md", f"{sid}:docs/release.md", f"{sid}:docs/deep/notes.txt"}


def test_a_vanished_repository_fails_the_sync_and_keeps_the_collection(
    app: Any, client: httpx.Client, roots: Path
) -> None:
    repo = make_repo(roots / "gone", {"a.md": "# A\n\nAlpha.\n", "b.md": "# B\n\nBravo.\n"})
    sid = add_source(client, type="git", url=repo.as_uri())["id"]
    assert sync(app, client, sid)["status"] == "succeeded"
    before = doc_ids(client)
    shutil.rmtree(repo)

    job = sync(app, client, sid)
    assert job["status"] == "failed"
    assert repo.as_uri() in job["error"]
    assert doc_ids(client) == before  # nothing removed
    shown = client.get(f"/v1/collections/kb/sources/{sid}").json()
    assert shown["last_sync"]["status"] == "failed" and repo.as_uri() in shown["last_sync"]["error"]
    assert shown["last_sync"]["counts"]["removed"] == 0
    assert shown["files"] == 2


# -- folders on the server -----------------------------------------------------------------------


def test_a_folder_source_under_an_allowed_root(app: Any, client: httpx.Client, roots: Path) -> None:
    folder = roots / "manuals"
    (folder / "sub").mkdir(parents=True)
    (folder / "pump.txt").write_text("The pump primes in thirty seconds.\n")
    (folder / "sub" / "valve.md").write_text("# Valve\n\nClose the valve clockwise.\n")
    (folder / "broken.txt").write_bytes(b"caf\xe9 au lait\n")  # not UTF-8
    sid = add_source(client, type="folder", url=str(folder), interval_minutes=0)["id"]
    job = sync(app, client, sid)
    assert job["status"] == "succeeded", job
    assert (job["result"]["added"], job["result"]["failed"]) == (2, 1)
    assert [e["filename"] for e in job["file_errors"]] == ["broken.txt"]
    assert "UTF-8" in job["file_errors"][0]["message"]
    assert doc_ids(client) == {f"{sid}:pump.txt", f"{sid}:sub/valve.md"}

    again = sync(app, client, sid)  # the broken file is unchanged: reported again, not parsed again
    assert (again["result"]["unchanged"], again["result"]["failed"], again["documents_total"]) == (2, 1, 0)
    (folder / "broken.txt").write_text("Fixed: café au lait.\n")
    fixed = sync(app, client, sid)
    assert (fixed["result"]["added"], fixed["result"]["failed"]) == (1, 0)
    shown = client.get(f"/v1/collections/kb/sources/{sid}").json()
    assert shown["next_sync_at"] is None  # on demand only
    # an emptied folder (an unmounted share looks like one) fails the sync; nothing is removed
    shutil.rmtree(folder)
    folder.mkdir()
    emptied = sync(app, client, sid)
    assert emptied["status"] == "failed" and "keeps the 3" in emptied["error"]
    assert len(doc_ids(client)) == 3


def test_local_paths_outside_the_allowed_roots_are_refused(
    app: Any, client: httpx.Client, roots: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the collection\n")
    (roots / "link").symlink_to(outside)
    repo = make_repo(tmp_path / "repo-outside", {"a.md": "# A\n"})
    for body in (
        {"type": "folder", "url": str(outside)},
        {"type": "folder", "url": str(roots / "link")},  # a link out of the roots
        {"type": "folder", "url": str(roots / ".." / "outside")},
        {"type": "git", "url": repo.as_uri()},
    ):
        r = client.post("/v1/collections/kb/sources", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == "url" and "TANDEM_RETRIEVAL_SOURCE_ROOTS" in error["message"]
        assert body["url"] in error["message"]
    r = client.post("/v1/collections/kb/sources", json={"type": "folder", "url": "relative/docs"})
    assert r.status_code == 400 and "absolute" in r.json()["error"]["message"]
    r = client.post("/v1/collections/kb/sources", json={"type": "folder", "url": str(roots / "missing")})
    assert r.status_code == 400 and "no such folder" in r.json()["error"]["message"]


def test_no_local_path_is_allowed_without_roots(
    retrieval_env: Path, api_key: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.retrieval.app import create_app

    monkeypatch.delenv("TANDEM_RETRIEVAL_SOURCE_ROOTS", raising=False)
    with serve_app(create_app()) as url, httpx.Client(base_url=url, headers=auth(api_key)) as c:
        c.post("/v1/collections", json={"name": "kb"}).raise_for_status()
        r = c.post("/v1/collections/kb/sources", json={"type": "folder", "url": str(tmp_path)})
        assert r.status_code == 400
        assert "no allowed source roots" in r.json()["error"]["message"]


# -- a website -----------------------------------------------------------------------------------


class Site:
    """A small website on 127.0.0.1, and the requests it got."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[tuple[str, str]] = []  # (path, user agent)
        site = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def do_GET(self) -> None:
                site.requests.append((self.path, self.headers.get("User-Agent", "")))
                super().do_GET()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def write(self, rel: str, text: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def paths(self) -> set[str]:
        return {p for p, _ in self.requests}


def page(title: str, body: str, *links: str) -> str:
    anchors = "".join(f'<p><a href="{href}">{href}</a></p>' for href in links)
    return (
        f"<html><head><title>{title}</title></head><body><h1>{title}</h1><p>{body}</p>{anchors}</body></html>"
    )


@pytest.fixture()
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path / "site")
    s.write("robots.txt", "User-agent: *\nDisallow: /private/\n")
    s.write(
        "index.html",
        page(
            "Beekeeping",
            "Bees need a water source near the hive.",
            "guide.html",
            "/private/secret.html",
            "deep/one.html",
            "notes.md",
            "logo.gif",
            f"http://localhost:{s.port}/offsite.html",  # another host name: not followed
            "guide.html#smoker",
        ),
    )
    s.write("guide.html", page("Guide", "Use a smoker to calm the colony."))
    s.write("private/secret.html", page("Secret", "Queen breeding plans."))
    s.write("deep/one.html", page("One", "Supers are added in spring.", "two.html"))
    s.write("deep/two.html", page("Two", "Varroa mites are counted in autumn.", "three.html"))
    s.write("deep/three.html", page("Three", "Beyond the depth limit."))
    s.write("notes.md", "# Notes\n\nHoney is extracted in late summer.\n")
    s.write("logo.gif", "not really a picture")
    s.write("offsite.html", page("Offsite", "Not this site."))
    s.thread.start()
    yield s
    s.server.shutdown()
    s.server.server_close()


def test_a_website_source_crawls_the_same_host_within_limits(
    app: Any, client: httpx.Client, site: Site
) -> None:
    source = add_source(client, type="web", url=site.url + "/index.html")
    sid = source["id"]
    job = sync(app, client, sid)
    assert job["status"] == "succeeded", job
    assert doc_ids(client) == {
        f"{sid}:/index.html",
        f"{sid}:/guide.html",
        f"{sid}:/deep/one.html",
        f"{sid}:/deep/two.html",  # depth 2
        f"{sid}:/notes.md",
    }
    requested = site.paths()
    assert "/robots.txt" in requested
    assert "/private/secret.html" not in requested  # robots.txt honoured: never fetched
    assert "/deep/three.html" not in requested  # beyond TANDEM_RETRIEVAL_SOURCE_WEB_MAX_DEPTH=2
    assert "/offsite.html" not in requested and "/logo.gif" not in requested
    assert all(agent.startswith("Tandem/") for _, agent in site.requests)
    guide = client.get(f"/v1/collections/kb/documents/{sid}:/guide.html").json()
    assert guide["title"] == "Guide" and guide["metadata"]["url"] == site.url + "/guide.html"
    assert "smoker" in guide["text"]

    site.write("guide.html", page("Guide", "Wear a veil near the hive."))
    (site.root / "notes.md").unlink()  # now a 404: it leaves the collection
    again = sync(app, client, sid)
    result = again["result"]
    assert (result["changed"], result["removed"], result["unchanged"], result["added"]) == (1, 1, 3, 0)
    assert f"{sid}:/notes.md" not in doc_ids(client)


def test_a_website_whose_start_page_is_gone_keeps_its_documents(
    app: Any, client: httpx.Client, site: Site
) -> None:
    sid = add_source(client, type="web", url=site.url + "/guide.html")["id"]
    assert sync(app, client, sid)["result"]["added"] == 1
    (site.root / "guide.html").unlink()
    job = sync(app, client, sid)
    assert job["status"] == "failed" and "404" in job["error"] and "/guide.html" in job["error"]
    assert doc_ids(client) == {f"{sid}:/guide.html"}


def test_private_addresses_are_refused_without_the_allowance(
    retrieval_env: Path, api_key: str, monkeypatch: pytest.MonkeyPatch, site: Site
) -> None:
    from services.retrieval.app import create_app
    from services.retrieval.sources.fetched import SourceError
    from services.retrieval.sources.web import fetch_web

    monkeypatch.delenv("TANDEM_RETRIEVAL_SOURCE_ALLOW_PRIVATE", raising=False)
    with serve_app(create_app()) as url, httpx.Client(base_url=url, headers=auth(api_key)) as c:
        c.post("/v1/collections", json={"name": "kb"}).raise_for_status()
        for body in (
            {"type": "web", "url": site.url + "/"},
            {"type": "git", "url": site.url + "/repo.git"},
            {"type": "git", "url": "http://[::1]/repo.git"},
            {"type": "web", "url": "http://169.254.169.254/latest/meta-data/"},
        ):
            r = c.post("/v1/collections/kb/sources", json=body)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == "url" and error["code"] == "address_refused"
            assert "TANDEM_RETRIEVAL_SOURCE_ALLOW_PRIVATE" in error["message"]
        assert "127.0.0.1" in c.post("/v1/collections/kb/sources", json={"type": "web", "url": site.url}).text
    # a sync checks again (a source added while it was allowed): the guard refuses to connect
    with pytest.raises(SourceError, match=r"127\.0\.0\.1"):
        fetch_web(
            site.url + "/",
            matcher([]),
            site.root.parent / "crawl",
            allow_private=False,
            max_depth=1,
            max_pages=10,
            max_bytes=1 << 20,
            timeout_s=5,
        )
    assert site.requests == []


# -- requests that are wrong ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"type": "svn", "url": "http://example.com/x"}, "type", ["svn"]),
        ({"type": "folder", "url": "/x", "paths": ["docs/[a"]}, "paths.0", ["docs/[a", "']'"]),
        ({"type": "folder", "url": "/x", "paths": ["**", "/etc/*"]}, "paths.1", ["/etc/*"]),
        ({"type": "folder", "url": "/x", "paths": ["../up/*"]}, "paths.0", ["../up/*"]),
        ({"type": "folder", "url": "/x", "interval_minutes": 2}, "interval_minutes", ["at least 5"]),
        ({"type": "folder", "url": "/x", "interval_minutes": 20_000}, "interval_minutes", ["10080"]),
        ({"type": "folder", "url": "/x", "interval_minutes": True}, "interval_minutes", []),
        ({"type": "web", "url": "https://example.com", "branch": "main"}, "branch", ["git"]),
        ({"type": "git", "url": "ssh://git@example.com/r.git"}, "url", ["ssh://git@example.com/r.git"]),
        (
            {"type": "git", "url": "https://example.com/r.git", "branch": "--upload-pack=x"},
            "branch",
            ["--upload"],
        ),
        ({"type": "web", "url": "ftp://example.com/"}, "url", ["ftp"]),
        ({"type": "web", "url": "https://user:pw@example.com/"}, "url", ["credentials"]),
    ],
)
def test_bad_sources_are_a_400_naming_the_field(
    client: httpx.Client, body: dict[str, Any], param: str, words: list[str]
) -> None:
    r = client.post("/v1/collections/kb/sources", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_unknown_collections_and_sources_are_404s_naming_them(
    client: httpx.Client, roots: Path, api_key: str, other_key: str, app: Any
) -> None:
    r = client.post("/v1/collections/nope/sources", json={"type": "folder", "url": str(roots)})
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    for method, path in (
        ("GET", "/v1/collections/kb/sources/src_missing"),
        ("DELETE", "/v1/collections/kb/sources/src_missing"),
        ("POST", "/v1/collections/kb/sources/src_missing/sync"),
    ):
        r = client.request(method, path)
        assert r.status_code == 404, r.text
        assert "'src_missing'" in r.json()["error"]["message"] and "'kb'" in r.json()["error"]["message"]
    sid = add_source(client, type="folder", url=str(roots))["id"]
    # another tenant sees neither the collection nor its sources
    with httpx.Client(base_url=app.state.url, headers=auth(other_key)) as other:
        assert other.get("/v1/collections/kb/sources").status_code == 404
        assert other.post(f"/v1/collections/kb/sources/{sid}/sync").status_code == 404
    r = client.post("/v1/collections/kb/sources", json={"type": "folder", "url": str(roots)})
    assert r.status_code == 409 and sid in r.json()["error"]["message"]


# -- syncs one at a time, on demand and on schedule -------------------------------------------------


def test_sync_now_while_a_sync_runs_answers_that_job(app: Any, client: httpx.Client, roots: Path) -> None:
    (roots / "a.txt").write_text("Alpha.\n")
    sid = add_source(client, type="folder", url=str(roots))["id"]
    first = client.post(f"/v1/collections/kb/sources/{sid}/sync").json()
    second = client.post(f"/v1/collections/kb/sources/{sid}/sync").json()
    assert second["job_id"] == first["job_id"] and second["already_running"] is True
    assert client.get(f"/v1/collections/kb/sources/{sid}").json()["syncing_job"] == first["job_id"]
    r = client.delete(f"/v1/collections/kb/sources/{sid}")
    assert r.status_code == 409 and first["job_id"] in r.json()["error"]["message"]


def test_deleting_a_source_removes_its_documents_unless_kept(
    app: Any, client: httpx.Client, roots: Path
) -> None:
    (roots / "one").mkdir()
    (roots / "one" / "a.txt").write_text("Alpha.\n")
    (roots / "two").mkdir()
    (roots / "two" / "b.txt").write_text("Bravo.\n")
    one = add_source(client, type="folder", url=str(roots / "one"))["id"]
    two = add_source(client, type="folder", url=str(roots / "two"))["id"]
    sync(app, client, one)
    sync(app, client, two)
    assert client.delete(f"/v1/collections/kb/sources/{one}").status_code == 204
    assert (
        client.delete(f"/v1/collections/kb/sources/{two}", params={"keep_documents": "true"}).status_code
        == 204
    )
    assert doc_ids(client) == {f"{two}:b.txt"}
    assert client.get("/v1/collections/kb/sources").json()["sources"] == []


def test_the_scheduler_starts_due_syncs_once(app: Any, client: httpx.Client, roots: Path) -> None:
    from services.retrieval.ingest import run_leased
    from services.retrieval.sources.schedule import start_due_syncs

    (roots / "a.txt").write_text("Alpha.\n")
    (roots / "manual").mkdir()
    (roots / "manual" / "b.txt").write_text("Bravo.\n")
    due = add_source(client, type="folder", url=str(roots), paths=["*.txt"], interval_minutes=10)
    add_source(client, type="folder", url=str(roots / "manual"), interval_minutes=0)  # never scheduled
    s = app.state
    queued: list[tuple[str, str, str]] = []

    def tick(now: float) -> list[str]:
        return start_due_syncs(s.collections, s.jobs, lambda *a: queued.append(a), now)

    created = due["created_at"]
    assert tick(created - 1) == []
    [job_id] = tick(created + 1)
    assert queued == [(TENANT, "kb", job_id)]
    assert tick(created + 2) == []  # queued: not started twice
    run_leased(s.collections, s.jobs, s.settings, TENANT, "kb", job_id)
    shown = client.get(f"/v1/collections/kb/sources/{due['id']}").json()
    assert shown["last_sync"]["status"] == "succeeded"
    next_at = shown["next_sync_at"]
    assert next_at == pytest.approx(shown["last_sync"]["finished_at"] + 600)
    assert tick(next_at - 1) == []
    [again] = tick(next_at + 1)
    assert again != job_id and len(queued) == 2


def test_the_beat_sends_the_tick_every_minute() -> None:
    from services.retrieval.sources.schedule import TICK_TASK
    from services.retrieval.worker import celery_app

    [entry] = celery_app.conf.beat_schedule.values()
    assert entry["task"] == TICK_TASK and entry["schedule"] == 60.0 and entry["options"]["queue"] == "io"
    assert TICK_TASK in celery_app.tasks


def test_globs() -> None:
    docs_md = matcher(["docs/**/*.md"])
    assert docs_md("docs/a.md") and docs_md("docs/x/y/a.md")
    assert not docs_md("a.md") and not docs_md("docs/a.txt") and not docs_md("other/docs/a.md")
    top = matcher(["*.md"])
    assert top("README.md") and not top("docs/a.md")
    anywhere = matcher(["**/*.md"])
    assert anywhere("README.md") and anywhere("a/b/c.md")
    assert matcher(["docs/"])("docs/a/b.txt") and not matcher(["docs/"])("docsx/a")
    assert matcher(["[!_]*.txt"])("a.txt") and not matcher(["[!_]*.txt"])("_a.txt")
    assert matcher(["?.md"])("a.md") and not matcher(["?.md"])("ab.md")
    assert matcher([])("anything/at/all")


def test_git_over_http_connects_to_the_address_the_guard_checked(site: Site, tmp_path: Path) -> None:
    """git is pinned to the checked address (``http.curloptResolve``): the host name in the URL
    is never looked up again by git, so a DNS answer that changes after the check is not used."""
    import asyncio

    from services.retrieval.sources.git import Remote, check_remote, checkout

    async def public(host: str, port: int) -> list[str]:
        return ["93.184.216.34"]

    url = f"http://docs.example.invalid:{site.port}/repo.git"
    remote = asyncio.run(check_remote(url, [], allow_private=False, resolver=public))
    assert remote.resolve == f"docs.example.invalid:{site.port}:93.184.216.34"

    repo = make_repo(tmp_path / "src", {"README.md": "# Served over HTTP\n"})
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(site.root / "repo.git"))
    git(site.root / "repo.git", "update-server-info")  # a "dumb" HTTP repository: its files as they are
    pinned = Remote(url, "http", f"docs.example.invalid:{site.port}:127.0.0.1")
    work, commit = checkout(pinned, "main", tmp_path / "cache", 60)
    assert (work / "README.md").read_text() == "# Served over HTTP\n"
    assert commit == git(repo, "rev-parse", "HEAD")
    assert any(p.startswith("/repo.git/") for p in site.paths())
