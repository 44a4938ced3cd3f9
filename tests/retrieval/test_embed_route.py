"""``POST /v1/collections/{name}/embed``: texts embedded with the collection's own embedder, the
one its searches use, in the retrieval service's process (real HTTP, the tiny embedder)."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np

from services.common.collection_embed import EMBED_TEXT_CHARS, EMBED_TEXTS


def test_the_vectors_are_the_collections_own_embedders(client: httpx.Client, tiny_embedder: Path) -> None:
    from sentence_transformers import SentenceTransformer

    assert client.post("/v1/collections", json={"name": "manual"}).status_code == 201
    texts = ["The server listens on port 8080 by default.", "Vérifiez le fichier de configuration.", "x"]
    got = client.post("/v1/collections/manual/embed", json={"input": texts})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["model"] == tiny_embedder.name  # the embedder its searches use
    vectors = np.array(body["vectors"], dtype=np.float32)
    own = SentenceTransformer(str(tiny_embedder), device="cpu").encode(texts, normalize_embeddings=True)
    assert vectors.shape == own.shape
    # the same vectors, in order, within the rounding of the embedder's dtype (bf16 on CPUs with it)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    cosines = vectors @ own.T
    assert (np.diag(cosines) > 0.9999).all(), cosines
    assert (np.argmax(cosines, axis=1) == np.arange(len(texts))).all()


def test_bad_input_is_a_4xx_naming_it(client: httpx.Client) -> None:
    assert client.post("/v1/collections", json={"name": "manual"}).status_code == 201
    for body, named in (
        ({"input": []}, "input"),
        ({"input": ["a"] * (EMBED_TEXTS + 1)}, "input"),
        ({"input": ["a" * (EMBED_TEXT_CHARS + 1)]}, "input"),
        ({"input": [1]}, "input"),
        ({"input": ["a"], "model": "other"}, "model"),
    ):
        resp = client.post("/v1/collections/manual/embed", json=body)
        assert resp.status_code == 400, (named, resp.text[:300])
        assert resp.json()["error"]["param"] == named
    missing = client.post("/v1/collections/nowhere/embed", json={"input": ["a"]})
    assert missing.status_code == 404 and "nowhere" in missing.text
