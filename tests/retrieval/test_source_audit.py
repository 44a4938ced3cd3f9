"""Sources in the audit log: adding a source, syncing it on demand and deleting it each append an
entry naming the collection, the source and who did it. Real HTTP, real Valkey, a real folder."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from services.common.audit import AuditEntry, AuditFilter, AuditLog
from services.common.redis_conn import async_redis
from tests.retrieval.test_sources import TENANT, add_source, sync
from tests.retrieval.test_sources import app as app  # the module's fixtures
from tests.retrieval.test_sources import client as client
from tests.retrieval.test_sources import roots as roots


def entries(redis_url: str, action: str) -> list[AuditEntry]:
    async def read() -> list[AuditEntry]:
        r = async_redis(redis_url)
        try:
            return (await AuditLog(r).entries(TENANT, AuditFilter(action=action)))[0]
        finally:
            await r.aclose()

    return asyncio.run(read())


def test_adding_syncing_and_deleting_a_source_are_recorded(
    app: Any, client: httpx.Client, roots: Path, redis_url: str, api_key: str
) -> None:
    key_id = api_key.split("_")[1]
    (roots / "notes").mkdir()
    (roots / "notes" / "a.txt").write_text("Alpha.\n")
    source = add_source(client, type="folder", url=str(roots / "notes"))["id"]
    job = sync(app, client, source)
    assert client.delete(f"/v1/collections/kb/sources/{source}").status_code == 204

    [added] = [e for e in entries(redis_url, "source.add") if e.detail["source"] == source]
    assert (added.target, added.actor.id, added.detail["type"]) == ("kb", key_id, "folder")
    assert added.detail["url"] == str(roots / "notes")
    [synced] = [e for e in entries(redis_url, "source.sync") if e.detail["source"] == source]
    assert (synced.target, synced.actor.id, synced.detail["job"]) == ("kb", key_id, job["id"])
    [deleted] = [e for e in entries(redis_url, "source.delete") if e.detail["source"] == source]
    assert (deleted.target, deleted.actor.id, deleted.detail["kept"]) == ("kb", key_id, False)
