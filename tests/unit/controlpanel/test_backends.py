"""The configured shared backends really work: embedded ones by default, PostgreSQL and
Redis when DATABASE_URL and REDIS_URL say so (the second CI tier)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.cache import cache
from django.db import connection


def test_database_engine_follows_database_url() -> None:
    url = os.environ.get("DATABASE_URL", "sqlite")
    expected = "postgresql" if url.startswith(("postgres", "pgsql")) else "sqlite"
    assert connection.vendor == expected


def test_redis_url_switches_channel_layer_broker_and_cache() -> None:
    layer_backend = settings.CHANNEL_LAYERS["default"]["BACKEND"]
    cache_backend = settings.CACHES["default"]["BACKEND"]
    if os.environ.get("REDIS_URL"):
        assert layer_backend == "channels_redis.core.RedisChannelLayer"
        assert cache_backend == "django.core.cache.backends.redis.RedisCache"
        assert os.environ["REDIS_URL"] == settings.CELERY_BROKER_URL
    else:
        assert layer_backend == "channels.layers.InMemoryChannelLayer"
        assert settings.CELERY_BROKER_URL == "cpfs://"  # controlpanel.broker


def test_channel_layer_round_trip() -> None:
    layer = get_channel_layer()
    assert layer is not None
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.send)(channel, {"type": "probe", "value": 42})
    assert async_to_sync(layer.receive)(channel) == {"type": "probe", "value": 42}


def test_shared_cache_round_trip() -> None:
    key = f"probe-{uuid.uuid4().hex}"
    cache.set(key, {"n": 1}, timeout=30)
    assert cache.get(key) == {"n": 1}


@pytest.mark.django_db
def test_database_round_trip() -> None:
    from controlpanel.registry.models import RoutingGeneration

    RoutingGeneration.bump()
    first = RoutingGeneration.current()
    RoutingGeneration.bump()
    assert RoutingGeneration.current() == first + 1


def test_filesystem_broker_messages_appear_whole(tmp_path: Path) -> None:
    """controlpanel.broker writes aside and renames, so a reader never sees a half file."""
    from kombu import Connection

    from controlpanel import broker

    broker.register()
    folders = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "control_folder": str(tmp_path / "control"),
    }
    (tmp_path / "control").mkdir()
    with Connection("cpfs://", transport_options=folders) as conn:
        queue = conn.SimpleQueue("whole")
        queue.put({"n": 1})
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
        assert [p.name.endswith(".whole.msg") for p in tmp_path.glob("*.msg")] == [True]
        message = queue.get(timeout=1)
        assert message.payload == {"n": 1}
        message.ack()
        queue.close()
