"""Fixtures for the cache tests: real redis-server processes on free loopback ports, stopped at the end."""

from __future__ import annotations

import pytest
from redisutil import HAS_REDIS, REASON


def _start(**kw):
    from trainloom.data.stores.redis_server import RedisServer

    return RedisServer(**kw).start()


@pytest.fixture(scope="session")
def redis_server():
    """One shared server for tests that do not break it (each test uses its own namespace)."""
    if not HAS_REDIS:
        pytest.skip(REASON)
    srv = _start()
    yield srv
    srv.stop()


@pytest.fixture
def own_redis():
    """A server per test, for tests that kill, pause or fill it."""
    if not HAS_REDIS:
        pytest.skip(REASON)
    servers = []

    def make(**kw):
        srv = _start(**kw)
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def redis_hosts(redis_server):
    return [redis_server.address()]
