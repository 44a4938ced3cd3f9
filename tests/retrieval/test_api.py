"""The HTTP API end to end over real HTTP (tiny embedder): collections, documents, search,
paging, replace/delete, tenant isolation, and each bad input a clear 4xx."""

from __future__ import annotations

import httpx
import pytest

DOCS = [
    {
        "id": "cats",
        "title": "Cats",
        "text": "Cats purr and chase mice around the barn.",
        "metadata": {"lang": "en", "year": 2020, "tags": "pets"},
    },
    {
        "id": "dogs",
        "title": "Dogs",
        "text": "Dogs bark at the mail carrier every morning.",
        "metadata": {"lang": "en", "year": 2018},
    },
    {
        "id": "hund",
        "title": "Hund",
        "text": "Der Hund bellt den Briefträger jeden Morgen an.",
        "metadata": {"lang": "de", "year": 2022},
    },
    {
        "id": "birds",
        "title": "Birds",
        "text": "Parrots can imitate human speech and whistle tunes.",
        "metadata": {"lang": "en", "year": 2023},
    },
]


def make(client: httpx.Client, name: str = "kb", **extra: object) -> dict:
    r = client.post("/v1/collections", json={"name": name, **extra})
    assert r.status_code == 201, r.text
    return r.json()


def ingest(client: httpx.Client, docs: list[dict], name: str = "kb") -> dict:
    r = client.post(f"/v1/collections/{name}/documents", json={"documents": docs})
    assert r.status_code == 201, r.text
    return r.json()


def search(client: httpx.Client, name: str = "kb", **body: object) -> list[dict]:
    r = client.post(f"/v1/collections/{name}/search", json=body)
    assert r.status_code == 200, r.text
    return r.json()["results"]


def test_collections_crud(client: httpx.Client) -> None:
    info = make(client, "kb", chunking={"size": 64, "overlap": 8}, index="flat")
    assert info["chunking"] == {"size": 64, "overlap": 8} and info["index"] == "flat"
    assert client.post("/v1/collections", json={"name": "kb"}).status_code == 409
    assert [c["name"] for c in client.get("/v1/collections").json()["collections"]] == ["kb"]
    ingest(client, DOCS)
    got = client.get("/v1/collections/kb").json()
    assert got["documents"] == 4 and got["chunks"] == 4 and got["index_type"] == "flat"
    assert client.delete("/v1/collections/kb").status_code == 204
    assert client.get("/v1/collections/kb").status_code == 404
    assert client.get("/v1/collections").json()["collections"] == []


def test_search_modes_shape_and_offsets(client: httpx.Client) -> None:
    make(client)
    ingest(client, DOCS)
    for mode in ("dense", "sparse", "hybrid"):
        hits = search(client, query="dogs bark at the mail carrier", mode=mode, top_k=3)
        assert hits, mode
        h = hits[0]
        assert set(h) >= {"chunk_id", "document_id", "text", "score", "scores", "metadata", "start", "end"}
        assert mode in h["scores"]
        doc = client.get(f"/v1/collections/kb/documents/{h['document_id']}").json()
        assert doc["text"][h["start"] : h["end"]] == h["text"]
    # The sparse ranking is exact-term: the dog document wins.
    assert search(client, query="bark mail carrier", mode="sparse")[0]["document_id"] == "dogs"
    hybrid = search(client, query="bark mail carrier", mode="hybrid")[0]
    assert set(hybrid["scores"]) >= {"sparse", "hybrid"}


def test_filters(client: httpx.Client) -> None:
    make(client)
    ingest(client, DOCS)

    def ids(filters: dict, mode: str = "hybrid") -> set[str]:
        return {
            h["document_id"] for h in search(client, query="animals", mode=mode, top_k=10, filters=filters)
        }

    assert ids({"lang": "de"}) == {"hund"}
    assert ids({"year": {"$gte": 2020}}) == {"cats", "hund", "birds"}
    assert ids({"year": {"$gt": 2018, "$lt": 2023}}) == {"cats", "hund"}
    assert ids({"lang": {"$in": ["de", "fr"]}}, mode="dense") == {"hund"}
    assert ids({"lang": {"$nin": ["de"]}}, mode="dense") == {"cats", "dogs", "birds"}
    assert ids({"$or": [{"lang": "de"}, {"year": 2018}]}, mode="dense") == {"hund", "dogs"}
    assert ids({"$and": [{"lang": "en"}, {"year": {"$lte": 2020}}]}, mode="dense") == {"cats", "dogs"}
    assert ids({"$not": {"lang": "en"}}, mode="dense") == {"hund"}
    assert ids({"lang": "xx"}) == set()
    # sparse respects filters too: "Hund" only matches the German document
    assert ids({"lang": "en"}, mode="sparse") <= {"cats", "dogs", "birds"}


def test_replace_same_id_and_delete(client: httpx.Client) -> None:
    make(client)
    ingest(client, DOCS)
    again = ingest(client, DOCS)
    assert again["chunks_added"] == 0 and again["chunks_unchanged"] == 4  # same text: nothing changes
    r = ingest(
        client,
        [
            {
                "id": "cats",
                "text": "Cats sleep sixteen hours a day on warm windowsills.",
                "metadata": {"lang": "en"},
            }
        ],
    )
    assert r["chunks_added"] == 1 and r["chunks_removed"] == 1
    assert client.get("/v1/collections/kb").json()["documents"] == 4
    hits = search(client, query="windowsills sleep", mode="sparse")
    assert [h["document_id"] for h in hits] == ["cats"]
    assert search(client, query="mice barn", mode="sparse") == []
    doc = client.get("/v1/collections/kb/documents/cats").json()
    assert doc["text"].startswith("Cats sleep") and doc["metadata"] == {"lang": "en"}
    assert client.delete("/v1/collections/kb/documents/cats").status_code == 204
    assert client.get("/v1/collections/kb/documents/cats").status_code == 404
    assert client.delete("/v1/collections/kb/documents/cats").status_code == 404
    assert all(h["document_id"] != "cats" for h in search(client, query="cats sleep", top_k=10))
    # duplicates within one request: the last one wins, one document
    ingest(client, [{"id": "x", "text": "first version"}, {"id": "x", "text": "second version"}])
    assert client.get("/v1/collections/kb/documents/x").json()["text"] == "second version"


def test_paging(client: httpx.Client) -> None:
    make(client)
    ingest(client, [{"id": f"d{i:02d}", "text": f"document number {i}"} for i in range(25)])
    seen = []
    offset: int | None = 0
    while offset is not None:
        page = client.get("/v1/collections/kb/documents", params={"limit": 10, "offset": offset}).json()
        assert page["total"] == 25
        seen += [d["id"] for d in page["documents"]]
        offset = page["next_offset"]
    assert seen == [f"d{i:02d}" for i in range(25)]
    assert client.get("/v1/collections/kb/documents", params={"limit": 0}).status_code == 400
    # full: each document as GET .../documents/{id} gives it (text and chunks), 100 a page at most
    listed = client.get("/v1/collections/kb/documents", params={"limit": 3, "offset": 7}).json()["documents"]
    assert all(d.get("text") is None and d.get("chunk_list") is None for d in listed)
    page = client.get("/v1/collections/kb/documents", params={"limit": 3, "offset": 7, "full": True}).json()
    assert page["documents"] == [
        client.get(f"/v1/collections/kb/documents/d{i:02d}").json() for i in (7, 8, 9)
    ]
    assert page["documents"][0]["text"] == "document number 7" and page["documents"][0]["chunk_list"]
    too_many = client.get("/v1/collections/kb/documents", params={"limit": 101, "full": True})
    assert too_many.status_code == 400 and "limit 101" in too_many.text


def test_tenant_isolation(client: httpx.Client, other_client: httpx.Client) -> None:
    make(client)
    ingest(client, DOCS)
    assert other_client.get("/v1/collections").json()["collections"] == []
    for method, path, body in [
        ("GET", "/v1/collections/kb", None),
        ("POST", "/v1/collections/kb/search", {"query": "cats"}),
        ("GET", "/v1/collections/kb/documents/cats", None),
        ("GET", "/v1/collections/kb/documents", None),
        ("POST", "/v1/collections/kb/documents", {"documents": [{"id": "evil", "text": "x"}]}),
        ("DELETE", "/v1/collections/kb/documents/cats", None),
        ("DELETE", "/v1/collections/kb", None),
    ]:
        r = other_client.request(method, path, json=body)
        assert r.status_code == 404, (method, path, r.text)
    # the other tenant may use the same name for its own collection
    make(other_client, "kb")
    assert other_client.post("/v1/collections/kb/search", json={"query": "cats"}).json()["results"] == []
    assert client.get("/v1/collections/kb").json()["documents"] == 4


def test_requires_key(service: str) -> None:
    assert httpx.get(f"{service}/v1/collections").status_code == 401


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"query": "x", "top_k": 0}, 400, "top_k"),
        ({"query": "x", "top_k": 101}, 400, "top_k"),
        ({"query": "x", "mode": "fuzzy"}, 400, "mode"),
        ({"query": ""}, 400, "query"),
        ({"query": "x", "filters": {"year": {"$between": [1, 2]}}}, 400, "$between"),
        ({"query": "x", "filters": {"$or": {"a": 1}}}, 400, "$or"),
        ({"query": "x", "filters": {"year": {"$in": []}}}, 400, "$in"),
        ({"query": "x", "filters": {"year": {"$gt": [1]}}}, 400, "filters.year.$gt"),
        ({"query": "x", "filters": ["lang"]}, 400, "filters"),
        ({"query": "x", "rerank": True}, 400, "reranker"),
    ],
)
def test_bad_search_input(client: httpx.Client, body: dict, status: int, needle: str) -> None:
    make(client)
    ingest(client, DOCS[:1])
    r = client.post("/v1/collections/kb/search", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_collection_input(client: httpx.Client) -> None:
    r = client.post("/v1/collections/nope/search", json={"query": "x"})
    assert r.status_code == 404 and "'nope'" in r.json()["error"]["message"]
    r = client.post("/v1/collections/nope/documents", json={"documents": [{"id": "a", "text": "b"}]})
    assert r.status_code == 404
    r = client.post("/v1/collections", json={"name": "../etc"})
    assert r.status_code == 400 and "../etc" in r.json()["error"]["message"]
    r = client.post("/v1/collections", json={"name": "kb", "chunking": {"size": 32, "overlap": 32}})
    assert r.status_code == 400 and "overlap" in r.json()["error"]["message"]
    r = client.post("/v1/collections", json={"name": "kb", "embedding_model": "/etc"})
    assert r.status_code == 400 and "outside the allowed roots" in r.json()["error"]["message"]
    r = client.post("/v1/collections", json={"name": "kb", "index": "annoy"})
    assert r.status_code == 400 and "index" in r.json()["error"]["message"]
    make(client)
    r = client.post("/v1/collections/kb/documents", json={"documents": []})
    assert r.status_code == 400 and "documents" in r.json()["error"]["message"]
    r = client.post("/v1/collections/kb/documents", json={"documents": [{"id": "a", "text": "   "}]})
    assert r.status_code == 400 and "blank" in r.json()["error"]["message"]
    r = client.post(
        "/v1/collections/kb/documents", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
