"""The Celery application; the broker comes from settings (filesystem or Redis)."""

import logging
import logging.config
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")

app = Celery("controlpanel")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["controlpanel.fleet", "controlpanel.rollouts"])


@setup_logging.connect
def _log_like_the_rest(loglevel: Any = None, **kwargs: Any) -> None:
    """Celery logs through settings.LOGGING, in the format every other process uses, rather
    than its own; `--loglevel` still sets how much of Celery's own it says."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel:
        logging.getLogger("celery").setLevel(loglevel)
