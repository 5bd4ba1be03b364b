"""Worker upstream keys are sealed in the database and clear in Python (controlpanel.sealed);
the end-to-end proof that the router, probes and LoRA calls still send them is
tests/e2e/test_worker_keys.py, which now reads every key back through the seal."""

from __future__ import annotations

import importlib
import logging

import pytest
from django.apps import apps
from django.db import connection
from django.test import override_settings

from controlpanel.registry import sealed
from controlpanel.registry.models import Worker

pytestmark = pytest.mark.django_db
migration = importlib.import_module("controlpanel.registry.migrations.0009_seal_worker_keys")
KEY = "wk-2b6e0d91c4"


def stored(worker: Worker) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT api_key FROM controlpanel_worker WHERE id = %s", [worker.pk])
        value: str = cursor.fetchone()[0]
    return value


def keyed_worker(key: str = KEY) -> Worker:
    return Worker.objects.create(url="http://10.0.0.7:8000", name="w", api_key=key)


def test_the_column_holds_a_sealed_token_and_python_the_key() -> None:
    worker = keyed_worker()
    raw = stored(worker)
    assert raw.startswith(sealed.PREFIX) and KEY not in raw
    assert Worker.objects.get(pk=worker.pk).api_key == KEY
    assert list(Worker.objects.values_list("api_key", flat=True)) == [KEY]
    assert sealed.seal(KEY) != sealed.seal(KEY)  # a fresh nonce each time: no equality leak


def test_no_key_stays_empty_and_is_found_as_empty() -> None:
    worker = keyed_worker("")
    assert stored(worker) == ""
    assert Worker.objects.filter(api_key="").get().pk == worker.pk


def test_a_rotated_secret_key_still_opens_with_the_old_one_as_fallback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with override_settings(SECRET_KEY="old-secret-" + "x" * 40):
        worker = keyed_worker()
    with override_settings(
        SECRET_KEY="new-secret-" + "y" * 40, SECRET_KEY_FALLBACKS=["old-secret-" + "x" * 40]
    ):
        assert Worker.objects.get(pk=worker.pk).api_key == KEY
    with override_settings(SECRET_KEY="new-secret-" + "y" * 40), caplog.at_level(logging.ERROR):
        assert Worker.objects.get(pk=worker.pk).api_key == ""  # read as unset, not a crash
    assert "does not open" in caplog.text and KEY not in caplog.text


def test_the_migration_seals_keys_saved_in_clear_and_can_open_them_again() -> None:
    worker = keyed_worker("")
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE controlpanel_worker SET api_key = %s WHERE id = %s", [KEY, worker.pk]
        )
    assert Worker.objects.get(pk=worker.pk).api_key == KEY  # a pre-seal row reads as it is
    migration.seal_stored_keys(apps, None)
    assert stored(worker).startswith(sealed.PREFIX)
    assert Worker.objects.get(pk=worker.pk).api_key == KEY

    class Editor:
        connection = connection

    migration.open_sealed_keys(apps, Editor())
    assert stored(worker) == KEY
