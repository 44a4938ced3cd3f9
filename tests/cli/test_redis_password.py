"""The embedded Valkey of `tandem up` requires a password made at first start and kept 0600,
listens on loopback only, and every Tandem client reaches it through a URL with the password."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import redis

from services.cli import stack
from services.common.config import CommonSettings
from services.common.redis_conn import redis_reachable, sync_redis
from tests.helpers.servers import free_port
from tests.helpers.waiting import wait_until


def test_embedded_valkey_refuses_clients_without_the_password(tmp_path: Path) -> None:
    layout = stack.Layout(tmp_path / "home")
    layout.make()
    common = CommonSettings(home=layout.home, redis_port=free_port())
    password = stack.ensure_redis_password(layout)
    assert stack.ensure_redis_password(layout) == password  # made once, then kept
    for secret in (layout.redis_password_file, layout.redis_conf):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    url, embedded = stack.redis_url_for(common, password)
    assert embedded and password in url and "127.0.0.1" in url
    [valkey] = [c for c in stack.plan(common, True, "cpu", layout.redis_conf) if c.name == "redis"]
    assert password not in " ".join(valkey.argv)  # not on the command line, where ps shows it
    assert valkey.argv[valkey.argv.index("--bind") + 1] == "127.0.0.1"
    proc = subprocess.Popen(valkey.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: proc.poll() is not None or redis_reachable(url), 15, "valkey starts")
        assert proc.poll() is None, "valkey exited"
        anonymous = redis.Redis(host="127.0.0.1", port=common.redis_port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=common.redis_port, password="wrong", socket_timeout=2).ping()
        client = sync_redis(url)
        assert client.ping() and client.config_get("bind")["bind"] == "127.0.0.1"
        # TANDEM_REDIS_PASSWORD with a password-less URL (compose's way) reaches it too
        via_setting = CommonSettings(
            redis_url=f"redis://127.0.0.1:{common.redis_port}/0", redis_password=password
        )
        assert sync_redis(via_setting.redis_url).ping()
        assert stack.redacted(url) == f"redis://:***@127.0.0.1:{common.redis_port}/0"
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_redis_clients_time_out_instead_of_hanging() -> None:
    import socket
    import threading

    # a server that accepts connections and never answers
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    port = srv.getsockname()[1]
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    from services.common import redis_conn

    old = redis_conn.SOCKET_TIMEOUT_S
    redis_conn.SOCKET_TIMEOUT_S = 0.5  # retries with backoff, then gives up
    try:
        client = sync_redis(f"redis://127.0.0.1:{port}/0")
        outcome: list[BaseException] = []

        def ping() -> None:
            try:
                client.ping()
            except BaseException as exc:
                outcome.append(exc)

        # in a thread, so that a client without timeouts (the old one) fails this test, not hangs it
        t = threading.Thread(target=ping, daemon=True)
        t.start()
        t.join(45)
        assert not t.is_alive(), "the Redis client hung on a server that does not answer"
        assert outcome and isinstance(outcome[0], redis.TimeoutError | redis.ConnectionError), outcome
    finally:
        redis_conn.SOCKET_TIMEOUT_S = old
        srv.close()
        for conn in held:
            conn.close()
