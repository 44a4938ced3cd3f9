"""A search with ``sentences``: each hit's candidate answer sentences, and the heading path they
are read under, scored against the query by the collection's own embedder in the retrieval
process (real HTTP, the tiny embedder), the same cosines the reader would get by embedding them
through ``/embed``."""

from __future__ import annotations

import httpx
import numpy as np

from services.common.candidates import answer_candidates
from tests.retrieval.test_api import make, search

MANUAL = b"""# Tidewater

## Configuration

### Listening port

The daemon listens on port 7411 unless the configuration says otherwise.
Set `listen_port` in tidewater.toml to move it.

### Log rotation

Logs rotate every night at two in the morning.
Each rotated file is compressed with zstd before it is moved aside.
What about older files?
They are removed after thirty days.
"""


def _cosines(client: httpx.Client, query: str, texts: list[str]) -> list[float]:
    got = client.post("/v1/collections/kb/embed", json={"input": [query, *texts]})
    assert got.status_code == 200, got.text
    vectors = np.array(got.json()["vectors"], dtype=np.float32)
    return [float(v) for v in vectors[1:] @ vectors[0]]


def test_hits_come_with_their_sentences_scored_against_the_query(client: httpx.Client) -> None:
    make(client, chunking={"size": 40, "overlap": 0})
    added = client.post("/v1/collections/kb/files", files=[("file", ("tidewater.md", MANUAL))])
    assert added.status_code == 201, added.text
    plain = search(client, query="which port does the daemon listen on", mode="sparse", top_k=3)
    assert all(hit.get("sentences") is None for hit in plain)  # only when asked for

    asked = "Which port does the daemon use?"
    hits = search(
        client,
        query="which port does the daemon listen on",
        mode="dense",  # every chunk of the manual, ranked
        top_k=3,
        section_tokens=200,
        sentences=True,
        sentence_query=asked,
    )
    assert hits and all(hit["sentences"] is not None for hit in hits)
    for hit in hits:
        from services.agent.chunks import Chunk

        chunk = Chunk.from_result(hit)
        # the reader's own candidates of what it reads (the section), no heading and no question
        expected = [c.text for c in answer_candidates([chunk])]
        assert [s["text"] for s in hit["sentences"]] == expected
        assert not any(s["text"].startswith("#") or s["text"].endswith("?") for s in hit["sentences"])
        assert hit["context"] == hit["section"] and hit["section"].startswith("Tidewater > Configuration >")
        # scored against sentence_query, as /embed's vectors score them
        want = _cosines(client, asked, [*expected, hit["context"]])
        got = [s["score"] for s in hit["sentences"]] + [hit["context_score"]]
        assert np.allclose(got, want, atol=2e-3), (got, want)
        # the agent's chunk keeps them by text, for the reader
        assert chunk.query_cosines[expected[0]] == hit["sentences"][0]["score"]
    texts = [s["text"] for hit in hits for s in hit["sentences"]]
    assert any("7411" in t for t in texts) and any("thirty days" in t for t in texts)


def test_bad_sentence_fields_are_400s_naming_them(client: httpx.Client) -> None:
    make(client)
    for body, named in (
        ({"query": "x", "sentences": "yes"}, "sentences"),
        ({"query": "x", "sentences": True, "sentence_query": "q" * 8193}, "sentence_query"),
    ):
        resp = client.post("/v1/collections/kb/search", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == named
