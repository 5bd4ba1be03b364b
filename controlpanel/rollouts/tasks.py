"""The rollout clock's Celery task, under the name it always had."""

from controlpanel.celery import app
from controlpanel.rollouts import clock


@app.task(name="controlpanel.rollouts_tick", ignore_result=True)
def rollouts_tick() -> int:
    return clock.rollouts_tick()
