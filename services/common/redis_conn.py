"""Redis connections (a real Redis, or the embedded Valkey server of `tandem up`)."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis


def sync_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, decode_responses=True, socket_connect_timeout=5, health_check_interval=30
    )


def async_redis(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, decode_responses=True, socket_connect_timeout=5, health_check_interval=30
    )


def redis_reachable(url: str, timeout: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False
