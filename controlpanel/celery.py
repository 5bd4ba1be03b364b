"""The Celery application; the broker comes from settings (filesystem or Redis)."""

import logging
import logging.config
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

from controlpanel import broker

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlpanel.settings")
# The embedded broker's transport ("cpfs://", the default without REDIS_URL), known to kombu
# before the app reads its broker URL.
broker.register()

log = logging.getLogger(__name__)
app = Celery("controlpanel")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["controlpanel.fleet", "controlpanel.rollouts"])


@app.task(name="controlpanel.periodic", ignore_result=True)
def periodic(names: list[str]) -> None:
    """Run the periodic tasks of one interval here, in order (settings' periodic_schedule):
    one failing does not keep the others from their turn."""
    for name in names:
        try:
            app.tasks[name]()  # a task called directly runs in this worker thread
        except Exception:
            log.exception("periodic task %s failed", name)


@setup_logging.connect
def _log_like_the_rest(loglevel: Any = None, **kwargs: Any) -> None:
    """Celery logs through settings.LOGGING, in the format every other process uses, rather
    than its own; `--loglevel` still sets how much of Celery's own it says."""
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
    if loglevel:
        logging.getLogger("celery").setLevel(loglevel)
