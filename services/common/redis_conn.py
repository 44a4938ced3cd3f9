"""Redis connections (a real Redis, or the embedded Valkey server of `tandem up`).

Every client has a connect timeout and a socket timeout (a Redis that stops answering
becomes an error, not a request that hangs for ever), checks idle connections before
use, and retries a command that failed on a broken connection with a short backoff, so
a Redis restart costs a few hundred milliseconds rather than every pooled connection.
"""

from __future__ import annotations

from typing import TypedDict

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

CONNECT_TIMEOUT_S = 5.0
# Longer than the longest blocking read a client makes (XREAD BLOCK 2 s in the trainer).
SOCKET_TIMEOUT_S = 30.0
RETRIES = 3
RETRY_ON = [redis.ConnectionError, redis.TimeoutError]


class ClientOptions(TypedDict):
    """What every Redis client of the stack is built with (sync and asyncio alike)."""

    socket_connect_timeout: float
    socket_timeout: float
    socket_keepalive: bool
    health_check_interval: int
    retry_on_error: list[type[redis.RedisError]]


def client_options() -> ClientOptions:
    return {
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "retry_on_error": RETRY_ON,
    }


def sync_redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url,
        decode_responses=True,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        **client_options(),
    )


def async_redis(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        retry=AsyncRetry(ExponentialBackoff(cap=1.0, base=0.05), RETRIES),
        **client_options(),
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
