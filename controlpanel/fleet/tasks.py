"""Thin Celery tasks of the fleet: each calls one service. Beat runs them on the schedule in
settings; their names are the ones they always had."""

from controlpanel.celery import app
from controlpanel.fleet import health, services


@app.task(name="controlpanel.expire_heartbeats", ignore_result=True)
def expire_heartbeats() -> int:
    return services.workers_expire_heartbeats()


@app.task(name="controlpanel.finish_drains", ignore_result=True)
def finish_drains() -> int:
    return services.workers_finish_drains()


@app.task(name="controlpanel.probe_workers", ignore_result=True)
def probe_workers() -> int:
    return health.workers_probe()
