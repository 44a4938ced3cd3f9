from __future__ import annotations

from pathlib import Path

import pytest

from services.common.readers import (
    SHARED,
    ReaderManifest,
    find_reader,
    is_reader_name,
    list_readers,
    publish_reader,
    reader_name,
)


def folder(tmp_path: Path, marker: str) -> Path:
    src = tmp_path / f"src-{marker}"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "weights.bin").write_text(marker)
    return src


def manifest(tenant: str, name: str = "ft-reader-abc") -> ReaderManifest:
    return ReaderManifest(
        name=name, tenant=tenant, base_model="all-MiniLM-L6-v2", job_id="ftjob-abc", threshold=0.3
    )


def test_a_tenant_finds_its_own_reader_first_then_a_shared_one_never_anothers(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert reader_name("ftjob-abc") == "ft-reader-abc" and is_reader_name("ft-reader-abc")
    assert not is_reader_name("ft-emb-abc") and not is_reader_name("ft-reader-../x")
    publish_reader(home, folder(tmp_path, "shared"), manifest(SHARED))
    publish_reader(home, folder(tmp_path, "shared2"), manifest(SHARED, "ft-reader-all"))
    publish_reader(home, folder(tmp_path, "acme"), manifest("acme"))
    mine = find_reader(home, "acme", "ft-reader-abc")
    assert mine is not None and (mine[0] / "weights.bin").read_text() == "acme"
    assert mine[1].threshold == 0.3 and mine[1].tenant == "acme"
    theirs = find_reader(home, "globex", "ft-reader-abc")  # acme's is not theirs: the shared one
    assert theirs is not None and (theirs[0] / "weights.bin").read_text() == "shared"
    assert find_reader(home, "globex", "../acme/ft-reader-abc") is None  # never a path
    assert [(m.name, m.tenant) for m in list_readers(home, "acme")] == [
        ("ft-reader-abc", "acme"),  # its own hides the shared one of the same name
        ("ft-reader-all", SHARED),
    ]
    assert [m.tenant for m in list_readers(home, "globex")] == [SHARED, SHARED]
    with pytest.raises(ValueError):  # only the shared folder starts with "_"
        publish_reader(home, folder(tmp_path, "x"), manifest("_other"))
