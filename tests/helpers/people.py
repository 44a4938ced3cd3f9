"""People of a tenant for tests: a user made with services/common/users.py and a personal token."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

from services.common.redis_conn import async_redis
from services.common.users import UserStore


@dataclass(frozen=True)
class Person:
    id: str
    token: str

    @property
    def entry(self) -> str:
        """The person as an access list names it."""
        return f"user:{self.id}"


def person(redis_url: str, tenant: str, role: str = "member", groups: tuple[str, ...] = ()) -> Person:
    """A new user of ``tenant`` (a fresh address) and a token of it."""

    async def make() -> Person:
        client = async_redis(redis_url)
        try:
            store = UserStore(client)
            user = await store.create(tenant, f"p{secrets.token_hex(4)}@example.org", role, list(groups))
            token, _ = await store.create_token(tenant, user.id, "tests")
            return Person(user.id, token)
        finally:
            await client.aclose()

    return asyncio.run(make())
