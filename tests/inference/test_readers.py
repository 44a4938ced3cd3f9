"""Published readers through /v1/rerank and /v1/models: a tiny random cross-encoder published as
one tenant's reader and another as a shared one; each tenant resolves its own, then the shared
ones, never another's; an operator acting for a tenant sees that tenant's; a reader published
again under its name is served anew."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from services.common.auth import KeyStore
from services.common.config import CommonSettings
from services.common.readers import SHARED, ReaderManifest, find_reader, publish_reader, reader_passage
from services.inference.app import create_app
from services.inference.config import InferenceSettings
from tests.conftest import auth
from tests.helpers.servers import serve_app
from tests.retrieval.test_protocols import make_tiny_cross_encoder

QUERY = "Where is the zoo?"
DOCS = [reader_passage("The zoo is in Elm street.", "Zoo > Visiting"), reader_passage("It rains.", None)]


@pytest.fixture(scope="module")
def keys(redis_url: str) -> dict[str, str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store = KeyStore(client)
        return {
            "acme": store.create("acme")[0],
            "globex": store.create("globex")[0],
            "operator": store.create("ops", operator=True)[0],
        }
    finally:
        client.close()


def publish(home: Path, source: Path, name: str, tenant: str, threshold: float | None = 0.4) -> Path:
    manifest = ReaderManifest(
        name=name,
        tenant=tenant,
        base_model="all-MiniLM-L6-v2",
        job_id="ftjob-" + name.removeprefix("ft-reader-"),
        metrics={"auc": 0.9, "auc_before": 0.5},
        threshold=threshold,
    )
    return publish_reader(home, source, manifest)


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, tiny_model_path: Path
) -> Iterator[tuple[str, Path, Path]]:
    home = tmp_path_factory.mktemp("readers-home")
    source = make_tiny_cross_encoder(tmp_path_factory.mktemp("ce") / "tiny-ce")
    publish(home, source, "ft-reader-acme1", "acme")
    publish(home, source, "ft-reader-all1", SHARED, threshold=None)
    common = CommonSettings(home=home, redis_url=redis_url, model_roots=str(source.parent), log_json=False)
    settings = InferenceSettings(
        model=str(tiny_model_path),
        served_model_name="tiny",
        max_model_len=128,
        rerank_models=f"tiny-rerank={source}",
        embedding_dtype="float32",
    )
    with serve_app(create_app(common, settings)) as url:
        yield url, home, source


def rerank(url: str, key: str, model: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/rerank",
        json={"model": model, "query": QUERY, "documents": DOCS},
        headers={**auth(key), **(headers or {})},
        timeout=60,
    )


def scores(resp: httpx.Response) -> list[float]:
    assert resp.status_code == 200, resp.text
    return [r["relevance_score"] for r in sorted(resp.json()["results"], key=lambda r: r["index"])]


def test_a_tenant_uses_its_readers_and_the_shared_ones_never_anothers(
    served: tuple[str, Path, Path], keys: dict[str, str]
) -> None:
    url, _, _ = served
    # the same weights as the configured rerank model: the same scores
    configured = scores(rerank(url, keys["acme"], "tiny-rerank"))
    assert scores(rerank(url, keys["acme"], "ft-reader-acme1")) == pytest.approx(configured, abs=1e-6)
    assert rerank(url, keys["acme"], "ft-reader-acme1").json()["model"] == "ft-reader-acme1"
    for key in (keys["acme"], keys["globex"]):
        assert scores(rerank(url, key, "ft-reader-all1")) == pytest.approx(configured, abs=1e-6)
    for key, model in ((keys["globex"], "ft-reader-acme1"), (keys["acme"], "ft-reader-none")):
        missing = rerank(url, key, model)
        assert missing.status_code == 404, missing.text
        error = missing.json()["error"]
        assert error["param"] == "model" and model in error["message"] and error["code"] == "model_not_found"
    # an operator acting for acme uses acme's readers; acting for globex, not
    acting = {"X-Tandem-Tenant": "acme"}
    assert rerank(url, keys["operator"], "ft-reader-acme1", acting).status_code == 200
    assert rerank(url, keys["operator"], "ft-reader-acme1", {"X-Tandem-Tenant": "globex"}).status_code == 404
    assert rerank(url, keys["globex"], "ft-reader-acme1", acting).status_code == 403


def test_models_list_a_tenants_readers_with_their_threshold(
    served: tuple[str, Path, Path], keys: dict[str, str]
) -> None:
    url, _, _ = served

    def readers(key: str) -> dict[str, dict[str, object]]:
        data = httpx.get(f"{url}/v1/models", headers=auth(key), timeout=30).json()["data"]
        return {c["id"]: c for c in data if str(c["id"]).startswith("ft-reader-")}

    mine = readers(keys["acme"])
    assert set(mine) == {"ft-reader-acme1", "ft-reader-all1"}
    assert mine["ft-reader-acme1"]["kind"] == "rerank" and mine["ft-reader-acme1"]["threshold"] == 0.4
    assert mine["ft-reader-acme1"]["owned_by"] == "acme" and mine["ft-reader-all1"]["owned_by"] == "tandem"
    assert set(readers(keys["globex"])) == {"ft-reader-all1"}
    one = httpx.get(f"{url}/v1/models/ft-reader-acme1", headers=auth(keys["acme"]), timeout=30)
    assert one.status_code == 200 and one.json()["threshold"] == 0.4
    assert httpx.get(f"{url}/v1/models/ft-reader-acme1", headers=auth(keys["globex"])).status_code == 404


def test_a_reader_published_again_is_served_anew(
    served: tuple[str, Path, Path], keys: dict[str, str], tmp_path: Path
) -> None:
    import torch
    from sentence_transformers import CrossEncoder

    url, home, source = served
    publish(home, source, "ft-reader-acme2", "acme")
    before = scores(rerank(url, keys["acme"], "ft-reader-acme2"))
    changed = CrossEncoder(str(source), device="cpu")
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.05)
    changed.save(str(tmp_path / "changed"))
    publish(home, tmp_path / "changed", "ft-reader-acme2", "acme")
    after = scores(rerank(url, keys["acme"], "ft-reader-acme2"))
    folder = find_reader(home, "acme", "ft-reader-acme2")
    assert folder is not None
    expected = CrossEncoder(str(folder[0]), device="cpu").predict([(QUERY, d) for d in DOCS])
    assert after == pytest.approx([float(x) for x in expected], abs=1e-5) and after != pytest.approx(before)
