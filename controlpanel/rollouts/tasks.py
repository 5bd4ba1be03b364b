"""The rollout clock's Celery task, under the name it always had."""

from celery import shared_task

from controlpanel.rollouts import clock


@shared_task(name="controlpanel.rollouts_tick", ignore_result=True)
def rollouts_tick() -> int:
    return clock.rollouts_tick()
