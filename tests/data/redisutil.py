"""Whether the Redis tests can run here: they need a redis-server binary and redis-py (both come
with the ``redis`` and ``test`` extras)."""

from __future__ import annotations

import importlib.util

import pytest

from trainloom._locate import find_redis_server

HAS_REDIS = find_redis_server() is not None and importlib.util.find_spec("redis") is not None
REASON = "needs a redis-server binary and redis-py (pip install 'trainloom[redis]')"
requires_redis = pytest.mark.skipif(not HAS_REDIS, reason=REASON)
