"""The vLLM Control Panel: Django project wiring and the control-plane app."""

from controlpanel.celery import app as celery_app

__all__ = ["celery_app"]
