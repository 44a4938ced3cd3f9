import pytest
import redis.asyncio as aioredis

from services.agent.memory import ConversationStore, MemoryLimits
from services.common.errors import NotFound

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store(redis_url: str):  # type: ignore[no-untyped-def]
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield ConversationStore(
        client, MemoryLimits(ttl_s=120, max_messages=4, max_conversations=3, max_chars=50)
    )
    await client.aclose()


async def test_roundtrip_caps_and_ttl(store: ConversationStore) -> None:
    cid = await store.create("acme", "k1", title="hello")
    for i in range(5):
        await store.append("acme", "k1", cid, [{"role": "user", "content": f"m{i} " + "x" * 100}])
    msgs = await store.messages("acme", "k1", cid)
    assert [m["content"][:2] for m in msgs] == ["m1", "m2", "m3", "m4"]  # newest 4 kept
    assert all(len(m["content"]) == 50 for m in msgs)  # each capped
    ttl = await store.r.ttl(f"tandem:agent:conv:acme:{cid}:messages")
    assert 0 < ttl <= 120
    assert (await store.get("acme", "k1", cid)).title == "hello"


async def test_isolation_between_tenants_and_users(store: ConversationStore) -> None:
    cid = await store.create("acme", "k1")
    for tenant, user in (("globex", "k1"), ("acme", "k2")):
        with pytest.raises(NotFound):
            await store.get(tenant, user, cid)
        with pytest.raises(NotFound):
            await store.delete(tenant, user, cid)
        assert cid not in [c.id for c in await store.list(tenant, user)]
    with pytest.raises(NotFound):
        await store.get("acme", "k1", "conv_../../etc")
    await store.delete("acme", "k1", cid)
    with pytest.raises(NotFound):
        await store.get("acme", "k1", cid)


async def test_oldest_conversations_are_evicted(store: ConversationStore) -> None:
    ids = [await store.create("evict", "u") for _ in range(5)]
    listed = [c.id for c in await store.list("evict", "u")]
    assert set(listed) == set(ids[2:])
    with pytest.raises(NotFound):
        await store.get("evict", "u", ids[0])
