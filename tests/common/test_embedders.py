from __future__ import annotations

from pathlib import Path

import pytest

from services.common.embedders import (
    EmbedderManifest,
    embedder_name,
    find_embedder,
    is_embedder_name,
    list_embedders,
    publish_embedder,
)


def model_folder(tmp_path: Path, marker: str) -> Path:
    src = tmp_path / f"src-{marker}"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "weights.bin").write_text(marker)
    return src


def manifest(tenant: str, name: str = "ft-emb-abc") -> EmbedderManifest:
    return EmbedderManifest(
        name=name, tenant=tenant, base_model="all-MiniLM-L6-v2", dim=384, job_id="ftjob-abc"
    )


def test_a_published_embedder_is_found_by_its_tenant_only_and_replaced_whole(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert embedder_name("ftjob-abc") == "ft-emb-abc" and is_embedder_name("ft-emb-abc")
    assert not is_embedder_name("all-MiniLM-L6-v2")
    folder = publish_embedder(home, model_folder(tmp_path, "one"), manifest("acme"))
    found = find_embedder(home, "acme", "ft-emb-abc")
    assert found is not None and found[0] == folder and found[1].dim == 384
    assert (folder / "weights.bin").read_text() == "one"
    assert find_embedder(home, "other", "ft-emb-abc") is None  # another tenant's name resolves to nothing
    assert find_embedder(home, "acme", "../other/ft-emb-abc") is None  # never a path
    publish_embedder(home, model_folder(tmp_path, "two"), manifest("acme"))
    assert (folder / "weights.bin").read_text() == "two"
    assert [m.name for m in list_embedders(home, "acme")] == ["ft-emb-abc"]
    assert sorted(p.name for p in folder.parent.iterdir()) == ["ft-emb-abc"]  # no staging left


def test_a_publish_that_fails_leaves_nothing_half_written(tmp_path: Path) -> None:
    home = tmp_path / "home"
    with pytest.raises(OSError):
        publish_embedder(home, tmp_path / "missing", manifest("acme"))
    assert find_embedder(home, "acme", "ft-emb-abc") is None
    assert list((home / "models" / "embedders" / "acme").iterdir()) == []
    with pytest.raises(ValueError):
        publish_embedder(home, model_folder(tmp_path, "x"), manifest("../evil"))
