"""Per-collection access lists (``/v1/collections/{name}/access``): who may read a collection and
who may also write it. A caller who may not read one meets the 404 of a missing collection on
every route (search, documents, originals, sources, jobs, settings), a reader who may not write
a 403 naming it, and the listing holds only what the caller may read. Real HTTP, real Valkey,
the real retrieval service with a tiny embedder; users and tokens made with
services/common/users.py."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute, iter_route_contexts

from services.common.audit import AuditFilter, AuditLog
from services.common.auth import KeyStore
from services.common.redis_conn import async_redis
from services.common.users import UserStore
from services.retrieval.api.deps import check_access
from tests.conftest import auth
from tests.helpers.people import Person, person
from tests.helpers.servers import serve_app

SECRETS = {
    "hr": ("salaries", "The salary bands for engineers are confidential payroll figures."),
    "eng": ("roadmap", "The roadmap plans the compiler rewrite for the autumn release."),
}


@pytest.fixture()
def service(retrieval_env: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # more than two documents in one request become an ingestion job (the jobs test needs one)
    monkeypatch.setenv("TANDEM_RETRIEVAL_ASYNC_DOCUMENTS", "2")
    from services.retrieval.app import create_app

    with serve_app(create_app()) as url:
        yield url


class Tenant:
    """A fresh tenant: its admin key, two collections with a document each, and people."""

    def __init__(self, url: str, redis_url: str, key_store: KeyStore) -> None:
        self.url, self.redis_url = url, redis_url
        self.name = f"t{secrets.token_hex(4)}"
        self.admin = key_store.create(self.name, "admin", role="admin")[0]
        for coll, (doc_id, text) in SECRETS.items():
            assert self.call("POST", "/v1/collections", self.admin, {"name": coll}).status_code == 201
            added = self.call(
                "POST",
                f"/v1/collections/{coll}/documents",
                self.admin,
                {"documents": [{"id": doc_id, "text": text}]},
            )
            assert added.status_code == 201, added.text

    def call(self, method: str, path: str, key: str, body: Any = None, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.url}{path}", json=body, headers=auth(key), timeout=60, **kw)

    def person(self, role: str = "member", groups: tuple[str, ...] = ()) -> Person:
        return person(self.redis_url, self.name, role, groups)

    def restrict(self, coll: str, readers: list[str], writers: list[str] | None = None) -> httpx.Response:
        body = {"readers": readers, "writers": writers or []}
        resp = self.call("PUT", f"/v1/collections/{coll}/access", self.admin, body)
        assert resp.status_code == 200, resp.text
        return resp

    def search(self, coll: str, key: str) -> httpx.Response:
        return self.call(
            "POST", f"/v1/collections/{coll}/search", key, {"query": "salary roadmap", "top_k": 5}
        )

    def listed(self, key: str) -> set[str]:
        resp = self.call("GET", "/v1/collections", key)
        assert resp.status_code == 200, resp.text
        return {c["name"] for c in resp.json()["collections"]}


@pytest.fixture()
def tenant(service: str, redis_url: str, key_store: KeyStore) -> Tenant:
    return Tenant(service, redis_url, key_store)


def error(resp: httpx.Response) -> dict[str, Any]:
    return dict(resp.json()["error"])


def assert_absent(resp: httpx.Response, coll: str) -> None:
    """The answer a collection that does not exist gets: nothing says it does."""
    assert resp.status_code == 404, resp.text
    assert error(resp)["code"] == "collection_not_found"
    assert error(resp)["message"] == f"collection {coll!r} not found"


def test_two_users_of_one_tenant_read_only_the_collection_they_may(
    tenant: Tenant, key_store: KeyStore
) -> None:
    alice = tenant.person()
    bob = tenant.person(groups=("engineering",))
    tenant.restrict("hr", [alice.entry])
    tenant.restrict("eng", ["group:engineering"])

    for who, mine, theirs in ((alice, "hr", "eng"), (bob, "eng", "hr")):
        found = tenant.search(mine, who.token)
        assert found.status_code == 200, found.text
        assert SECRETS[mine][1] in {hit["text"] for hit in found.json()["results"]}
        assert tenant.listed(who.token) == {mine}
        doc_id = SECRETS[theirs][0]
        # every way into the other's collection is the 404 of a collection that does not exist
        for method, path in (
            ("POST", f"/v1/collections/{theirs}/search"),
            ("POST", f"/v1/collections/{theirs}/embed"),
            ("GET", f"/v1/collections/{theirs}"),
            ("GET", f"/v1/collections/{theirs}/documents"),
            ("GET", f"/v1/collections/{theirs}/documents/{doc_id}"),
            ("GET", f"/v1/collections/{theirs}/originals/{doc_id}"),
            ("GET", f"/v1/collections/{theirs}/sources"),
            ("GET", f"/v1/collections/{theirs}/access"),
            ("DELETE", f"/v1/collections/{theirs}/documents/{doc_id}"),
            ("DELETE", f"/v1/collections/{theirs}"),
        ):
            bodies = {"/search": {"query": "salary roadmap"}, "/embed": {"input": ["salary"]}}
            body = next((b for end, b in bodies.items() if path.endswith(end)), None)
            assert_absent(tenant.call(method, path, who.token, body), theirs)
        assert_absent(tenant.call("GET", "/v1/collections/nowhere", who.token), "nowhere")
        # its own document is there (the original's 404 is the document's, not the collection's)
        mine_doc = tenant.call("GET", f"/v1/collections/{mine}/documents/{SECRETS[mine][0]}", who.token)
        assert mine_doc.status_code == 200 and mine_doc.json()["text"] == SECRETS[mine][1]
        no_original = tenant.call("GET", f"/v1/collections/{mine}/originals/{SECRETS[mine][0]}", who.token)
        assert error(no_original)["code"] == "no_original"

    # the tenant's admin reads both; a member key named nowhere reads neither; one named does
    assert tenant.listed(tenant.admin) == {"hr", "eng"}
    assert tenant.search("hr", tenant.admin).status_code == 200
    key, record = key_store.create(tenant.name, "bot", role="member")
    assert tenant.listed(key) == set()
    tenant.restrict("eng", ["group:engineering", f"key:{record.key_id}"])
    assert tenant.listed(key) == {"eng"} and tenant.search("eng", key).status_code == 200


def test_a_reader_who_may_not_write_gets_a_403_naming_the_collection(tenant: Tenant) -> None:
    reader, writer = tenant.person(), tenant.person(groups=("people-ops",))
    viewer = tenant.person(role="viewer")
    tenant.restrict("hr", [reader.entry, viewer.entry], ["group:people-ops", viewer.entry])
    doc = {"documents": [{"id": "new", "text": "Leave policy: twenty-five days a year."}]}

    for method, path, body, files in (
        ("POST", "/v1/collections/hr/documents", doc, None),
        ("POST", "/v1/collections/hr/files", None, {"file": ("a.txt", b"leave policy")}),
        ("DELETE", "/v1/collections/hr/documents/salaries", None, None),
        ("POST", "/v1/collections/hr/sources", {"type": "folder", "url": "/srv/hr"}, None),
        ("PATCH", "/v1/collections/hr", {"ocr_language": "en"}, None),
        ("POST", "/v1/collections/hr/rollback", None, None),
        ("DELETE", "/v1/collections/hr", None, None),
        ("GET", "/v1/collections/hr/access", None, None),
    ):
        refused = tenant.call(method, path, reader.token, body, files=files)
        assert refused.status_code == 403, (method, path, refused.text)
        assert "'hr'" in error(refused)["message"] and reader.id in error(refused)["message"]
    # it still reads, and embeds with the collection's embedder (a read)
    assert tenant.search("hr", reader.token).status_code == 200
    assert (
        tenant.call("POST", "/v1/collections/hr/embed", reader.token, {"input": ["leave"]}).status_code == 200
    )
    # a writer writes; a viewer named a writer is still a viewer, who never writes
    assert tenant.call("POST", "/v1/collections/hr/documents", writer.token, doc).status_code == 201
    assert tenant.call("POST", "/v1/collections/hr/documents", viewer.token, doc).status_code == 403
    assert tenant.search("hr", viewer.token).status_code == 200
    shown = tenant.call("GET", "/v1/collections/hr/access", writer.token)
    assert shown.status_code == 200 and shown.json()["readers"] == sorted([reader.entry, viewer.entry])


def test_only_admins_change_access_and_each_change_is_audited(tenant: Tenant) -> None:
    alice = tenant.person(groups=("finance",))
    member_put = tenant.call("PUT", "/v1/collections/hr/access", alice.token, {"readers": [], "writers": []})
    assert member_put.status_code == 403 and "admin" in error(member_put)["message"]

    open_ = tenant.call("GET", "/v1/collections/hr/access", tenant.admin).json()
    assert open_ == {"collection": "hr", "open": True, "readers": [], "writers": [], "updated_at": None}
    # an open collection: every member writes it, so may see who may
    assert tenant.call("GET", "/v1/collections/hr/access", alice.token).status_code == 200

    put = tenant.restrict("hr", [alice.entry, alice.entry, "group:finance"], [alice.entry])
    assert put.json()["readers"] == ["group:finance", alice.entry] and put.json()["open"] is False
    # an admin-only list: nobody but the admins
    tenant.restrict("hr", [], [])
    assert_absent(tenant.search("hr", alice.token), "hr")
    assert tenant.search("hr", tenant.admin).status_code == 200
    removed = tenant.call("DELETE", "/v1/collections/hr/access", tenant.admin)
    assert removed.status_code == 204
    assert tenant.search("hr", alice.token).status_code == 200 and tenant.listed(alice.token) == {"hr", "eng"}

    async def entries() -> list[Any]:
        client = async_redis(tenant.redis_url)
        try:
            found, _ = await AuditLog(client).entries(tenant.name, AuditFilter(action="collection.access"))
            return found
        finally:
            await client.aclose()

    logged = list(reversed(asyncio.run(entries())))
    assert [e.target for e in logged] == ["hr", "hr", "hr"]
    assert logged[0].detail == {
        "before": None,
        "after": {"readers": ["group:finance", alice.entry], "writers": [alice.entry]},
    }
    assert logged[1].detail["after"] == {"readers": [], "writers": []}
    assert logged[2].detail == {"before": {"readers": [], "writers": []}, "after": None}
    assert all(e.actor.kind == "key" for e in logged)


def test_unknown_people_groups_and_keys_are_404s_and_malformed_entries_400s(
    tenant: Tenant, key_store: KeyStore
) -> None:
    alice = tenant.person(groups=("finance",))
    elsewhere = person(tenant.redis_url, f"o{secrets.token_hex(4)}", groups=("secret-club",))
    foreign_key = key_store.create(f"o{secrets.token_hex(4)}", "x")[1].key_id

    def put(readers: list[str], writers: list[str] | None = None) -> httpx.Response:
        body = {"readers": readers, "writers": writers or []}
        return tenant.call("PUT", "/v1/collections/hr/access", tenant.admin, body)

    for readers, writers, named, code in (
        (["user:u_0000000000000000"], [], "u_0000000000000000", "user_not_found"),
        ([elsewhere.entry], [], elsewhere.id, "user_not_found"),  # another tenant's user
        ([alice.entry], ["group:secret-club"], "secret-club", "group_not_found"),
        ([f"key:{foreign_key}"], [], foreign_key, "key_not_found"),
    ):
        refused = put(readers, writers)
        assert refused.status_code == 404, refused.text
        assert error(refused)["code"] == code and named in error(refused)["message"]
    for bad in ("alice", "team:x", "user:", "group:-x", "user:a b"):
        refused = put([alice.entry, bad])
        assert refused.status_code == 400, refused.text
        assert error(refused)["param"] == "readers[1]" and repr(bad) in error(refused)["message"]
    too_many = put([alice.entry] * 257)
    assert too_many.status_code == 400 and "readers" in str(error(too_many)["param"])
    extra = tenant.call(
        "PUT", "/v1/collections/hr/access", tenant.admin, {"readers": [], "writers": [], "x": 1}
    )
    assert extra.status_code == 400
    # nothing above changed anything; a missing collection is a 404 too
    assert tenant.call("GET", "/v1/collections/hr/access", tenant.admin).json()["open"] is True
    assert_absent(
        tenant.call("PUT", "/v1/collections/gone/access", tenant.admin, {"readers": [], "writers": []}),
        "gone",
    )


def test_an_entry_kept_from_before_is_not_checked_again(tenant: Tenant) -> None:
    """A person who left stays named until an admin removes them; changing the rest of the list
    does not wait on it, naming them anew does."""
    alice, gone = tenant.person(), tenant.person()
    tenant.restrict("hr", [alice.entry, gone.entry])

    async def remove() -> None:
        client = async_redis(tenant.redis_url)
        try:
            await UserStore(client).delete(tenant.name, gone.id)
        finally:
            await client.aclose()

    asyncio.run(remove())
    kept = tenant.call(
        "PUT", "/v1/collections/hr/access", tenant.admin, {"readers": [gone.entry], "writers": []}
    )
    assert kept.status_code == 200 and kept.json()["readers"] == [gone.entry], kept.text
    renamed = tenant.call(
        "PUT", "/v1/collections/hr/access", tenant.admin, {"readers": [], "writers": [gone.entry]}
    )
    assert renamed.status_code == 200, renamed.text  # a kept entry, moved: still no new name
    tenant.restrict("hr", [alice.entry])
    again = tenant.call(
        "PUT",
        "/v1/collections/hr/access",
        tenant.admin,
        {"readers": [alice.entry, gone.entry], "writers": []},
    )
    assert again.status_code == 404 and gone.id in error(again)["message"]


def test_jobs_of_a_collection_the_caller_may_not_read_are_missing(tenant: Tenant) -> None:
    alice, bob = tenant.person(), tenant.person()
    tenant.restrict("hr", [alice.entry], [alice.entry])
    docs = [{"id": f"d{i}", "text": f"policy number {i}"} for i in range(3)]
    queued = tenant.call("POST", "/v1/collections/hr/documents", alice.token, {"documents": docs})
    assert queued.status_code == 202, queued.text
    job_id = queued.json()["job_id"]
    assert tenant.call("GET", f"/v1/jobs/{job_id}", alice.token).status_code == 200
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events"):
        hidden = tenant.call("GET", path, bob.token)
        assert hidden.status_code == 404 and error(hidden)["code"] == "job_not_found"


def test_a_deleted_collection_takes_its_list_with_it(tenant: Tenant) -> None:
    alice = tenant.person()
    tenant.restrict("hr", [tenant.person().entry])
    assert tenant.call("DELETE", "/v1/collections/hr", tenant.admin).status_code == 204
    # a new collection of that name is the tenant's, open as any new one
    assert tenant.call("POST", "/v1/collections", alice.token, {"name": "hr"}).status_code == 201
    assert tenant.call("GET", "/v1/collections/hr/access", alice.token).json()["open"] is True
    assert "hr" in tenant.listed(alice.token)


def test_every_route_of_a_named_collection_applies_its_access_list(retrieval_env: Path) -> None:
    """A route added later under /v1/collections/{name} cannot forget the check."""
    from services.retrieval.app import create_app

    app = create_app()
    named = [
        (str(c.path), c.original_route)
        for c in iter_route_contexts(app.routes)
        if str(c.path).startswith("/v1/collections/{name}")
    ]
    assert len(named) >= 15
    for path, route in named:
        assert isinstance(route, APIRoute), path
        assert check_access in [d.call for d in route.dependant.dependencies], path
